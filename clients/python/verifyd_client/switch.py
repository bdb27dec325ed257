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

In a captured graph each layer is two CUDA graph conditional nodes (torch's
``begin_capture_to_if_node``): the op's call runs when the step is the op's, and the stack's
attention when the step is the stack's or the op's call failed its device checks
(kernel_op.py), so a failed call is never served. The path not taken costs no kernel of its own.
Outside a captured graph the stack's attention serves. torch 2.11 has no conditional-node API:
there ``attend`` in a capture raises FAILED_PRECONDITION naming the torch version.

The block's mode: "stack" (the stack serves), "op" (the op serves), "canary" (a step is the op's
with probability ``canary_fraction``, drawn on the device per step). With a lease (``renew``),
the op serves only while renewals come within the period: a controller that dies or stops
leaves the stack serving from the next step, with no host involved.
"""

import ctypes

import grpc

from . import cuda_driver, kernel_op
from .errors import InvalidBundleError, VerifydError

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


class Switch:
    """The per-step choice for ``layers`` layers on one device."""

    def __init__(self, layers, device=None, library=None):
        torch = _torch()
        self._lib = kernel_op.load_library(library)
        self._lib.verifyd_switch_decide.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                    ctypes.c_void_p, ctypes.c_uint32,
                                                    ctypes.c_void_p]
        self._lib.verifyd_switch_decide.restype = ctypes.c_int
        self.layers = int(layers)
        if not 1 <= self.layers <= 1 << 16:
            raise InvalidBundleError(f"layers: {layers}, expected 1 to 65536")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else int(device))
        # The control block: pinned host memory, which the device reads through its mapping.
        self._host = torch.zeros(ctypes.sizeof(_Block), dtype=torch.uint8, pin_memory=True)
        self.block = _Block.from_address(self._host.data_ptr())
        with torch.cuda.device(self.device):
            self._block_device = cuda_driver.host_device_pointer(self._host.data_ptr())
            self.use_op = torch.zeros((), dtype=torch.bool, device=self.device)
            self.layer_failed = torch.ones(self.layers, dtype=torch.bool, device=self.device)
        self.block.magic = MAGIC
        self.conditional_nodes = hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")

    def set_mode(self, mode, canary_fraction=0.0):
        """What the next steps serve: "stack", "op" or "canary" (the op on ``canary_fraction`` of
        the steps)."""
        if mode not in MODES:
            raise InvalidBundleError(f"mode: '{mode}', expected one of {', '.join(MODES)}")
        if not 0.0 <= float(canary_fraction) <= 1.0:
            raise InvalidBundleError(f"canary_fraction: {canary_fraction} is outside [0, 1]")
        self.block.canary_threshold = min(int(float(canary_fraction) * 2**32), 2**32 - 1)
        self.block.mode = MODES[mode]

    def renew(self, period_s):
        """Renews the lease for ``period_s`` (0: no lease). The device counts the period from when
        it first sees the renewal."""
        self.block.lease_period_us = int(round(float(period_s) * 1e6))
        self.block.lease_epoch += 1

    def counters(self):
        b = self.block
        return {"steps": b.steps, "op_steps": b.op_steps, "lease_expired": b.lease_expired}

    def begin_step(self):
        """Enqueues the step's decision on the current stream; once per step, before its
        layers."""
        torch = _torch()
        rc = self._lib.verifyd_switch_decide(self._block_device, self.use_op.data_ptr(),
                                             self.layer_failed.data_ptr(), self.layers,
                                             torch.cuda.current_stream(self.device).cuda_stream)
        if rc != 0:
            raise VerifydError(grpc.StatusCode.INTERNAL,
                               f"verifyd_switch_decide: CUDA error {rc} enqueueing the step")

    def attend(self, layer, stack_fn, op, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask,
               o, lse=None, graph=None):
        """Layer ``layer``'s attention: the op's call into ``o`` (and ``lse``) when the step is
        the op's, ``stack_fn()`` (which writes the same outputs) when it is the stack's or the
        op's call failed. ``graph``: the CUDAGraph being captured, when torch cannot say."""
        torch = _torch()
        if not 0 <= layer < self.layers:
            raise InvalidBundleError(f"layer: {layer} is outside [0, {self.layers})")
        if not torch.cuda.is_current_stream_capturing():
            return stack_fn()
        if not self.conditional_nodes:
            raise VerifydError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"torch {torch.__version__} has no CUDA graph conditional nodes "
                               "(begin_capture_to_if_node)")
        if graph is None:
            current = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
            graph = current() if current else None
        if graph is None:
            raise InvalidBundleError("graph: pass the CUDAGraph being captured")
        failed = self.layer_failed[layer]
        graph.begin_capture_to_if_node(self.use_op)
        try:
            op.attend(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o, lse,
                      failed=failed)
        finally:
            graph.end_capture_to_conditional_node()
        graph.begin_capture_to_if_node(failed)
        try:
            stack_fn()
        finally:
            graph.end_capture_to_conditional_node()
        return None
