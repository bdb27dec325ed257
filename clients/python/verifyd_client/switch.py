"""The switch between the stack's own attention and the custom kernel, inside a captured step.

The stack's forward pass holds both its attention and a VerifyKernel; one of them serves each
step, chosen on the device from a control block (host memory the device reads) that whoever
controls the serving writes: its mode, a canary fraction, a lease.

    switch = Switch(layers=61)
    with torch.cuda.graph(g):
        switch.begin_step()                    # the step's decision, on the device
        for layer in range(61):
            ...
            switch.attend(layer, lambda: stack_attention(...), op, q, pool, kv_indptr,
                          kv_indices, kv_lens, tree_mask, o)
    switch.set_mode("op")                      # the next replay serves the op

``switch.step(forward)`` captures the step as a single IF/ELSE node instead (``forward`` is the
stack's forward pass, called twice while capturing: once with the op in every layer, once with the
stack's attention), so that a step pays for one conditional node, not one a layer; the op's
calls keep their per-layer fallback (a nested IF).

With ``begin_step`` and ``attend`` in a capture, each layer is one CUDA graph IF/ELSE conditional node, made by the kernel
library (kernels/op/verify_switch.cu, CUDA 12.8+ drivers): the op's call runs when the step is
the op's, followed by ``stack_fn`` when the call failed its device checks (kernel_op.py), so a
failed call is never served; ``stack_fn`` runs alone when the step is the stack's. The path not
taken launches nothing. ``stack_fn`` is called twice while capturing (once for each body it can
run in) on the switch's own stream, which is current for it; what it allocates comes from the
switch's memory pool. It may launch kernels, copies and memsets, but not record or wait on events
(a conditional body holds no event nodes).

Eagerly, or with ``conditional=False`` (or a driver without conditional nodes), a layer is a
kernel-side branch: ``stack_fn`` always runs, then the op's call, which computes nothing unless
the step is the op's, into buffers of its own, and copies them over ``stack_fn``'s output only
when it served and passed every check.

Under verifyd's control, the block is a switch channel's (``SwitchChannel``, or
``Switch(..., client=VerifyClient(...), model="kimi-k2")``): verifyd writes the mode (shadow: the
stack; canary: its fraction; custom: the op) and renews the lease every quarter period; the flip,
the gate and a rollback work as for any call, and ``verifyctl status`` shows the switch's steps.
The library must be verifyd's own build (``verifyd_op_build()``), or verifyd refuses the channel.
Without a client, the process writes the block itself (``set_mode``, ``renew``).

The block's mode: "stack" (the stack serves), "op" (the op serves), "canary" (a step is the op's
with probability ``canary_fraction``, drawn on the device per step). With a lease (``renew``),
the op serves only while renewals come within the period: a controller that dies or stops
leaves the stack serving from the next step, with no host involved.
"""

import ctypes
import itertools

import grpc

from . import cuda_driver, kernel_op
from ._channel_memory import HEADER_BYTES, ChannelMemory, close_channel
from ._proto import verify_pb2
from .errors import InvalidBundleError, VerifydError

_names = itertools.count()

MAGIC = 0x56445357
MODES = {"stack": 0, "op": 1, "canary": 2}


class _Block(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint32), ("mode", ctypes.c_uint32),
                ("canary_threshold", ctypes.c_uint32), ("lease_period_us", ctypes.c_uint32),
                ("lease_epoch", ctypes.c_uint64), ("steps", ctypes.c_uint64),
                ("op_steps", ctypes.c_uint64), ("lease_expired", ctypes.c_uint64),
                ("seen_epoch", ctypes.c_uint64), ("seen_at_ns", ctypes.c_uint64),
                ("last_step_ns", ctypes.c_uint64)]


def _torch():
    import torch  # noqa: PLC0415 - the switch needs torch with CUDA, the package does not
    return torch


class SwitchChannel:
    """A switch channel at verifyd (verify.proto, SwitchSpec): the control block lives in the
    channel's shared memory, where verifyd writes the mode and renews the lease; with
    ``mapped``, registered with CUDA (``device_block``: where the GPU reads it). ``build``: the
    kernel library's build (it must be verifyd's). ``lease_ms``: 0 for verifyd's default."""

    BYTE_SIZE = HEADER_BYTES + 2 * 4096

    def __init__(self, client, layers, model, build, lease_ms=0, mapped=True):
        self.name = f"{client.client_id}-switch{next(_names)}"
        self._stub, self.timeout = client._stub, client.timeout  # noqa: SLF001
        self._open = False
        self._mem = ChannelMemory(self.BYTE_SIZE, client.target, mapped=mapped)
        spec = verify_pb2.SwitchSpec(layers=int(layers), model=model, build=build,
                                     lease_ms=int(lease_ms))
        resp = self._mem.open(self._stub, self.timeout, name=self.name,
                              client=client.client_id, serving_switch=spec)
        self._open = True
        self.key, self.offset = self._mem.key, resp.request_offset
        self.block = _Block.from_address(self._mem.base + resp.request_offset)
        self.device_block = (self._mem.dbase + resp.request_offset
                             if self._mem.dbase is not None else None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Closes the channel at verifyd (which hands the stack back first) and frees the
        memory. No captured step may read the block afterwards."""
        try:
            if getattr(self, "_open", False):
                self._open = False
                close_channel(self._stub, self.name, self.timeout)
        finally:
            # Freed even when verifyd cannot be told (its client closed, verifyd gone): verifyd
            # closes the channel itself when this process exits.
            self.block = None
            if getattr(self, "_mem", None) is not None:
                self._mem.free()
                self._mem = None


def _bind(lib):
    p, i, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32
    lib.verifyd_switch_conditional_nodes.restype = u32
    lib.verifyd_switch_create.argtypes = [u32, u32, ctypes.c_char_p, u32]
    lib.verifyd_switch_create.restype = p
    lib.verifyd_switch_destroy.argtypes = [p]
    lib.verifyd_switch_error.argtypes = [p]
    lib.verifyd_switch_error.restype = ctypes.c_char_p
    lib.verifyd_switch_begin_step.argtypes = [p, p, p, p, p]
    lib.verifyd_switch_layer_op.argtypes = [p, u32, p, ctypes.POINTER(kernel_op._Call), p,  # noqa: SLF001
                                            ctypes.POINTER(p)]
    lib.verifyd_switch_layer_else.argtypes = [p, ctypes.POINTER(p)]
    lib.verifyd_switch_layer_end.argtypes = [p]
    lib.verifyd_switch_layer_abort.argtypes = [p]
    lib.verifyd_switch_layer_branch.argtypes = [p, u32, p, ctypes.POINTER(kernel_op._Call), p,  # noqa: SLF001
                                                p, p]
    lib.verifyd_switch_step_op.argtypes = [p, p, p, p, p, ctypes.POINTER(p)]
    lib.verifyd_switch_layer_in_step.argtypes = [p, u32, p, ctypes.POINTER(kernel_op._Call),  # noqa: SLF001
                                                 ctypes.POINTER(p)]
    lib.verifyd_switch_fallback_end.argtypes = [p]
    lib.verifyd_switch_step_stack.argtypes = [p, ctypes.POINTER(p)]
    lib.verifyd_switch_step_end.argtypes = [p]
    lib.verifyd_switch_step_op_redo.argtypes = [p, p, p, p, p, ctypes.POINTER(p)]
    lib.verifyd_switch_layer_in_redo_step.argtypes = [p, u32, p,
                                                      ctypes.POINTER(kernel_op._Call)]  # noqa: SLF001
    lib.verifyd_switch_step_redo.argtypes = [p, ctypes.POINTER(p)]
    for f in ("begin_step", "layer_op", "layer_else", "layer_end", "layer_branch", "step_op",
              "layer_in_step", "fallback_end", "step_stack", "step_end", "step_op_redo",
              "layer_in_redo_step", "step_redo"):
        getattr(lib, "verifyd_switch_" + f).restype = i


class Switch:
    """The per-step choice for ``layers`` layers (1 to 1024) on one device. ``conditional``:
    None uses conditional nodes where the driver has them, True requires them, False takes the
    kernel-side branch. ``client``: a VerifyClient whose verifyd controls the switch (a
    SwitchChannel named ``model``; ``lease_ms`` 0: verifyd's default); without one, the process
    writes the block itself."""

    def __init__(self, layers, device=None, library=None, conditional=None, client=None,
                 model="default", lease_ms=0):
        torch = _torch()
        self._lib = kernel_op.load_library(library)
        _bind(self._lib)
        self.layers = int(layers)
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else int(device))
        available = bool(self._lib.verifyd_switch_conditional_nodes())
        if conditional and not available:
            raise VerifydError(grpc.StatusCode.FAILED_PRECONDITION,
                               "conditional: the CUDA driver runs no IF/ELSE conditional nodes "
                               "(CUDA 12.8 or later needed); pass conditional=False for the "
                               "kernel-side branch")
        self.conditional = available if conditional is None else bool(conditional)
        error = ctypes.create_string_buffer(512)
        with torch.cuda.device(self.device):
            self._sw = self._lib.verifyd_switch_create(self.layers, int(self.conditional), error,
                                                       len(error))
            if not self._sw:
                raise InvalidBundleError(error.value.decode())
            if client is not None:
                self.channel = SwitchChannel(client, self.layers, model,
                                             self._lib.verifyd_op_build().decode(), lease_ms)
                self.block, self._block_device = self.channel.block, self.channel.device_block
            else:
                # The control block: pinned host memory, which the device reads through its
                # mapping.
                self.channel = None
                self._host = torch.zeros(ctypes.sizeof(_Block), dtype=torch.uint8,
                                         pin_memory=True)
                self._block_device = cuda_driver.host_device_pointer(self._host.data_ptr())
                self.block = _Block.from_address(self._host.data_ptr())
                self.block.magic = MAGIC
            self.use_op = torch.zeros((), dtype=torch.bool, device=self.device)
            self.layer_failed = torch.ones(self.layers, dtype=torch.bool, device=self.device)
            self._pool = torch.cuda.MemPool() if hasattr(torch.cuda, "MemPool") else None
        self._scratch = {}
        self._in_step = None  # while step() captures: "op" or "stack", the body being captured
        self._in_pool = False  # while _run_on has the pool taking this thread's allocations

    def close(self):
        """Destroys the switch (and closes its channel). No captured step may run afterwards."""
        if getattr(self, "_sw", None):
            self._lib.verifyd_switch_destroy(self._sw)
            self._sw = None
        if getattr(self, "channel", None) is not None:
            self.channel.close()
            self.channel = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise; close() freed what it could
            pass

    def _own_block(self, what):
        if self.channel is not None:
            raise VerifydError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{what}: verifyd controls this switch (flip it with verifyctl)")

    def set_mode(self, mode, canary_fraction=0.0):
        """What the next steps serve: "stack", "op" or "canary" (the op on ``canary_fraction`` of
        the steps). Only for a switch without a client."""
        self._own_block("set_mode")
        if mode not in MODES:
            raise InvalidBundleError(f"mode: '{mode}', expected one of {', '.join(MODES)}")
        if not 0.0 <= float(canary_fraction) <= 1.0:
            raise InvalidBundleError(f"canary_fraction: {canary_fraction} is outside [0, 1]")
        self.block.canary_threshold = min(int(float(canary_fraction) * 2**32), 2**32 - 1)
        self.block.mode = MODES[mode]

    def renew(self, period_s):
        """Renews the lease for ``period_s`` (0: no lease). The device counts the period from when
        it first sees the renewal. Only for a switch without a client."""
        self._own_block("renew")
        self.block.lease_period_us = int(round(float(period_s) * 1e6))
        self.block.lease_epoch += 1

    def counters(self):
        b = self.block
        return {"steps": b.steps, "op_steps": b.op_steps, "lease_expired": b.lease_expired}

    def _check(self, rc, what):
        if rc != 0:
            why = self._lib.verifyd_switch_error(self._sw).decode()
            raise VerifydError(grpc.StatusCode.INTERNAL, f"{what}: {why} (CUDA error {rc})")

    def _stream(self):
        return _torch().cuda.current_stream(self.device).cuda_stream

    def begin_step(self):
        """Enqueues the step's decision on the current stream; once per step, before its
        layers."""
        self._check(self._lib.verifyd_switch_begin_step(
            self._sw, self._block_device, self.use_op.data_ptr(), self.layer_failed.data_ptr(),
            self._stream()), "begin_step")

    def step(self, forward, redo=False):
        """Captures one step as a single IF/ELSE conditional node: ``forward()`` (the stack's
        forward pass, calling ``attend`` in its layers) is called twice, once for the op's step
        (each layer the op's call, and the stack's attention after a call that failed) and once
        for the stack's, on the switch's stream with its memory pool. A step then costs one
        conditional node, not one a layer. ``forward`` must leave its results in tensors made
        before the step (what it returns is dropped). Outside a capture, or without conditional
        nodes: ``begin_step()`` and one ``forward()``, each layer a kernel-side branch.

        ``redo``: no fallback node a layer; instead, when the op served the step and any layer's
        call failed, the whole step runs again with the stack's attention (``forward()`` is
        captured a third time). Only for a forward pass that gives the same results when run
        again from the step's inputs."""
        torch = _torch()
        if not (self.conditional and torch.cuda.is_current_stream_capturing()):
            self.begin_step()
            forward()
            return
        body = ctypes.c_void_p()
        step_op = self._lib.verifyd_switch_step_op_redo if redo else self._lib.verifyd_switch_step_op
        self._check(step_op(
            self._sw, self._block_device, self.use_op.data_ptr(), self.layer_failed.data_ptr(),
            self._stream(), ctypes.byref(body)), "step_op")
        try:
            self._in_step = "op_redo" if redo else "op"
            self._run_on(body.value, forward)
            self._check(self._lib.verifyd_switch_step_stack(self._sw, ctypes.byref(body)),
                        "step_stack")
            self._in_step = "stack"
            self._run_on(body.value, forward)
            if redo:
                self._check(self._lib.verifyd_switch_step_redo(self._sw, ctypes.byref(body)),
                            "step_redo")
                self._run_on(body.value, forward)
        except BaseException:
            self._lib.verifyd_switch_layer_abort(self._sw)
            raise
        finally:
            self._in_step = None
        self._check(self._lib.verifyd_switch_step_end(self._sw), "step_end")

    def _run_on(self, stream, fn):
        """``fn()`` with ``stream`` (the switch's, capturing a body) current and the switch's
        pool taking what it allocates."""
        torch = _torch()
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
            # Inside a step's body the thread already allocates from the pool (torch refuses a
            # second use_mem_pool): a layer's fallback inside it only changes the stream.
            if self._pool is None or self._in_pool:
                return fn()
            self._in_pool = True
            try:
                with torch.cuda.use_mem_pool(self._pool):
                    return fn()
            finally:
                self._in_pool = False

    def attend(self, layer, stack_fn, op, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask,
               o, lse=None):
        """Layer ``layer``'s attention: the op's call into ``o`` (and ``lse``) when the step is
        the op's, ``stack_fn()`` (which writes the same outputs) when it is the stack's or the
        op's call failed."""
        torch = _torch()
        if not 0 <= layer < self.layers:
            raise InvalidBundleError(f"layer: {layer} is outside [0, {self.layers})")
        failed = self.layer_failed[layer]
        if self._in_step == "stack":
            return stack_fn()
        if self._in_step == "op_redo":
            c, _ = op.call_struct(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o, lse,
                                  failed)
            self._check(self._lib.verifyd_switch_layer_in_redo_step(
                self._sw, layer, op._op, ctypes.byref(c)), "layer_in_redo_step")  # noqa: SLF001
            return None
        if self._in_step == "op":
            c, _ = op.call_struct(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o, lse,
                                  failed)
            fb = ctypes.c_void_p()
            self._check(self._lib.verifyd_switch_layer_in_step(
                self._sw, layer, op._op, ctypes.byref(c), ctypes.byref(fb)),  # noqa: SLF001
                "layer_in_step")
            self._run_on(fb.value, stack_fn)
            self._check(self._lib.verifyd_switch_fallback_end(self._sw), "fallback_end")
            return None
        if self.conditional and torch.cuda.is_current_stream_capturing():
            c, _ = op.call_struct(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o, lse,
                                  failed)
            body = ctypes.c_void_p()
            self._check(self._lib.verifyd_switch_layer_op(self._sw, layer, op._op,  # noqa: SLF001
                                                          ctypes.byref(c), self._stream(),
                                                          ctypes.byref(body)), "layer_op")
            try:
                self._run_on(body.value, stack_fn)
                self._check(self._lib.verifyd_switch_layer_else(self._sw, ctypes.byref(body)),
                            "layer_else")
                self._run_on(body.value, stack_fn)
            except BaseException:
                self._lib.verifyd_switch_layer_abort(self._sw)
                raise
            self._check(self._lib.verifyd_switch_layer_end(self._sw), "layer_end")
            return None
        out = stack_fn()
        key = (tuple(o.shape), lse is not None)
        if key not in self._scratch:
            self._scratch[key] = (torch.empty_like(o),
                                  torch.empty_like(lse) if lse is not None else None)
        so, slse = self._scratch[key]
        c, _ = op.call_struct(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, so, slse,
                              failed)
        self._check(self._lib.verifyd_switch_layer_branch(
            self._sw, layer, op._op, ctypes.byref(c), o.data_ptr(),  # noqa: SLF001
            lse.data_ptr() if lse is not None else None, self._stream()), "layer_branch")
        return out
