"""Doorbell channels: verify calls that a CUDA stream makes, so that a CUDA graph can capture them
(verify.proto, OpenChannelRequest.descriptors; the layout is src/channel/doorbell_layout.h).

Once, at setup: each call's fixed part is named as a descriptor (the q, KV pool, kv_indices,
tree mask and o buffers at their largest shapes, CUDA tensors in allocations registered through
the client's cuda_ipc transport), e.g. one per layer. Once per forward pass, ``set_layout`` puts
the batch, kv_indptr and kv_lens (device tensors) into a layout slot; per layer, ``call`` names
a descriptor and the slot. Both only enqueue work on the current stream: a device-to-host copy
into the channel's registered shared memory, and three stream memory operations
(cuStreamWriteValue32 rings the doorbell, cuStreamWaitValue32 waits for the done word,
cuStreamWriteValue32 resets it). No host synchronisation, no gRPC, no numpy: they capture into a
CUDA graph, and replaying the graph makes the calls.

A failed call does not stop the stream: verifyd zero-fills its o, writes the status into the done
word and counts it; ``failed_calls()``, ``last_response()`` and ``check()`` read them on the host.
If verifyd exits (or closes the channel) while a stream waits on a call, a watchdog thread answers
the ring with UNAVAILABLE, so the graph goes on with that call's o left as it was, and
``check()`` raises.

``VerifyStep`` is the serving-stack shape on top: one descriptor per layer (its KV pool), shared
static q/o/kv_indices/tree_mask buffers that the step copies into and out of on the GPU, and the
caller's own ``o`` written in place.
"""

import itertools
import math
import os
import platform
import socket
import struct
import threading

import grpc

from . import cuda_driver
from ._channel_memory import HEADER_BYTES, ChannelMemory, close_channel
from ._proto import types_pb2, verify_pb2
from . import tensors
from .bundle import HEAD_DIM_QK, HEAD_DIM_V, checked_kv_scale, wire_kv_dtype
from .errors import InvalidBundleError, VerifydError, status_code
from .regions import OFFSET_GRID, ref

# Byte offsets of the header's doorbell-mode words (src/channel/channel_layout.h).
_STATE_AT, _DOORBELL_AT, _DONE_AT, _FAILED_AT = 192, 256, 320, 384
_RESPONSE_BYTES_AT = 132
_STATE_OPEN = 1
_RUNG, _DONE = 0x80000000, 0x1
_UNAVAILABLE = 14  # google.rpc.Code
_names = itertools.count()


def _torch():
    import torch  # noqa: PLC0415 - doorbell channels need torch with CUDA, the package does not
    return torch


def ring_word(descriptor, slot):
    if not 0 <= descriptor < 1 << 16:
        raise ValueError(f"descriptor: {descriptor} is outside 0 to 65535")
    if not 0 <= slot < 1 << 15:
        raise ValueError(f"slot: {slot} is outside 0 to 32767")
    return _RUNG | slot << 16 | descriptor


def slot_words(max_batch):
    return 3 + 2 * max_batch


def _cuda_ref(transport, name, t, dtype):
    region, offset = transport.register(t)
    if offset % OFFSET_GRID:
        raise InvalidBundleError(f"{name}: starts {offset} bytes into its CUDA allocation, not a "
                                 f"multiple of {OFFSET_GRID}")
    return ref("cuda_ipc", region, offset, dtype, t.shape)


class Descriptor:
    """One call's fixed part: CUDA tensors at their largest shapes, all on one device.

    q bf16 [max_batch*T, H, 576] (or [max_batch*T, H*576]); kv_pool [pages, page, 576] of bf16,
    or of torch.float8_e4m3fn whose values are e4m3 x ``kv_scale`` (SGLang's k_scale; None: 1);
    kv_indices int32 [max_indices]; tree_mask uint8 [max_batch, T, T] (mask_format "bytes") or
    [max_batch, T, ceil(T/8)] ("bits"); o bf16 [max_batch*T, H, 512] (or 2-D); lse f32
    [max_batch*T, H] when given. sm_scale: the model's own softmax scale.
    """

    def __init__(self, q, kv_pool, kv_indices, tree_mask, o, sm_scale, lse=None,
                 mask_format="bytes", kv_scale=None):
        rows = int(q.shape[0])
        if q.dim() == 2:
            q = q.view(rows, -1, HEAD_DIM_QK)
        if o.dim() == 2:
            o = o.view(int(o.shape[0]), -1, HEAD_DIM_V)
        self.q, self.kv_pool, self.kv_indices, self.tree_mask, self.o, self.lse = (
            q, kv_pool, kv_indices, tree_mask, o, lse)
        self.sm_scale, self.mask_format = float(sm_scale), mask_format
        self.kv_scale = kv_scale
        self.max_batch, self.draft = int(tree_mask.shape[0]), int(tree_mask.shape[1])
        self.heads = int(q.shape[1])

    def to_request(self, transport):
        torch = _torch()
        for name, t in (("q", self.q), ("kv_pool", self.kv_pool), ("kv_indices", self.kv_indices),
                        ("tree_mask", self.tree_mask), ("o", self.o)):
            if not (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous()):
                raise InvalidBundleError(f"{name}: expected a contiguous torch CUDA tensor")
            if t.device != self.q.device:
                raise InvalidBundleError(f"{name}: on {t.device}, q on {self.q.device}")
        kv_dtype = tensors.kv_dtype_of("kv_pool", self.kv_pool)
        kv_scale = checked_kv_scale(kv_dtype, self.kv_scale)
        req = verify_pb2.VerifyRequest(sm_scale=self.sm_scale, device=self.q.device.index,
                                       want_lse=self.lse is not None)
        if kv_dtype == tensors.KV_E4M3:
            req.kv_scale = kv_scale
        req.mask_format = (verify_pb2.MASK_FORMAT_BITS if self.mask_format == "bits"
                           else verify_pb2.MASK_FORMAT_BYTES)
        req.q.CopyFrom(_cuda_ref(transport, "q", self.q, types_pb2.DTYPE_BF16))
        req.kv_pool.CopyFrom(_cuda_ref(transport, "kv_pool", self.kv_pool, wire_kv_dtype(kv_dtype)))
        req.kv_indices.CopyFrom(_cuda_ref(transport, "kv_indices", self.kv_indices,
                                          types_pb2.DTYPE_I32))
        req.tree_mask.CopyFrom(_cuda_ref(transport, "tree_mask", self.tree_mask,
                                         types_pb2.DTYPE_U8))
        req.o_out.CopyFrom(_cuda_ref(transport, "o", self.o, types_pb2.DTYPE_BF16))
        if self.lse is not None:
            req.lse_out.CopyFrom(_cuda_ref(transport, "lse", self.lse, types_pb2.DTYPE_F32))
        return req


class DoorbellChannel:
    """A doorbell channel of a VerifyClient whose transport is cuda_ipc
    (``client.doorbell_channel(descriptors)``). One stream calls through it at a time."""

    def __init__(self, client, descriptors, layout_slots=2):
        torch = _torch()
        if platform.machine() not in ("x86_64", "AMD64"):
            raise NotImplementedError("doorbell channels need x86-64")
        if getattr(client._transport, "kind", None) != "cuda_ipc":  # noqa: SLF001
            raise InvalidBundleError("doorbell channels need a client with transport='cuda_ipc'")
        if not descriptors:
            raise InvalidBundleError("descriptors: at least one")
        self.max_batch, self.draft = descriptors[0].max_batch, descriptors[0].draft
        self.device = descriptors[0].q.device
        self.descriptors = list(descriptors)
        self.slots = layout_slots
        self._slot_bytes = -(-4 * slot_words(self.max_batch) // 64) * 64
        area = max(4096, -(-layout_slots * self._slot_bytes // 64) * 64)
        byte_size = HEADER_BYTES + 2 * area
        self.name = f"{client.client_id}-db{next(_names)}"
        self._stub, self.timeout = client._stub, client.timeout  # noqa: SLF001
        self._open = False
        reqs = [d.to_request(client._transport) for d in self.descriptors]  # noqa: SLF001
        self._mem = ChannelMemory(byte_size, client.target, mapped=True)
        resp = self._mem.open(self._stub, self.timeout, name=self.name, client=client.client_id,
                              descriptors=reqs, layout_slots=layout_slots)
        self._shm, self._words, self._base = self._mem.shm, self._mem.words, self._mem.base
        self._dbase = self._mem.dbase
        self._open = True
        self._request_at, self._response_at = resp.request_offset, resp.response_offset
        assert resp.layout_slot_bytes == self._slot_bytes and resp.max_batch == self.max_batch
        with torch.cuda.device(self.device):
            self._staging = torch.zeros(layout_slots, slot_words(self.max_batch),
                                        dtype=torch.int32, device=self.device)
        self._failed_seen = 0
        self.released = 0  # rings the watchdog answered because verifyd was gone
        self._watch_stop = threading.Event()
        self._verifyd = _verifyd_process(client.target)
        self._watchdog = threading.Thread(target=self._watch, name=f"{self.name}-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # On the stream ------------------------------------------------------------------------

    def set_layout(self, kv_indptr, kv_lens, batch=None, slot=0, reuse=True):
        """Enqueues the layout of the next calls into ``slot``: kv_indptr [B+1] and kv_lens [B]
        (integer tensors on the channel's device), B <= max_batch. ``batch``: the batch the
        calls serve when it is less than B (an int, or a device int32 tensor of one element,
        e.g. the real batch within a CUDA-graph bucket).

        ``reuse``: the slot gets a new generation (each replay of a captured graph too), and
        verifyd reads the page ids and mask that the calls' descriptors name once per
        generation, at its first call on each of its lanes; so write them before
        ``set_layout``, and call it again after changing them. False: they are read at every
        call."""
        torch = _torch()
        b = int(kv_lens.shape[0])
        if not 1 <= b <= self.max_batch:
            raise InvalidBundleError(f"kv_lens: {b} requests, the channel takes 1 to "
                                     f"{self.max_batch}")
        if int(kv_indptr.shape[0]) != b + 1:
            raise InvalidBundleError(f"kv_indptr: {int(kv_indptr.shape[0])} entries, expected "
                                     f"B + 1 = {b + 1}")
        if not 0 <= slot < self.slots:
            raise InvalidBundleError(f"slot: {slot}, the channel has {self.slots}")
        s = self._staging[slot]
        if batch is None:
            s[0].fill_(b)
        elif isinstance(batch, torch.Tensor):
            s[0:1].copy_(batch.reshape(1))
        else:
            s[0].fill_(int(batch))
        if reuse:
            s[1:2].add_(1)  # int32: wraps, through 0 (read at every call) once in 2^32
        else:
            s[1].fill_(0)
        s[2:3 + b].copy_(kv_indptr)
        s[3 + self.max_batch:3 + self.max_batch + b].copy_(kv_lens)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        cuda_driver.copy_to_host_async(self._base + self._request_at + slot * self._slot_bytes,
                                       s.data_ptr(), 4 * slot_words(self.max_batch), stream)

    def call(self, descriptor, slot=0):
        """Enqueues one call of descriptor ``descriptor`` with the layout in ``slot``: the work
        after it on the stream sees the descriptor's o written (or zero-filled on an error)."""
        torch = _torch()
        if not 0 <= descriptor < len(self.descriptors):
            raise InvalidBundleError(f"descriptor: {descriptor}, the channel has "
                                     f"{len(self.descriptors)}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        cuda_driver.stream_write32(stream, self._dbase + _DOORBELL_AT, ring_word(descriptor, slot))
        cuda_driver.stream_wait32(stream, self._dbase + _DONE_AT, _DONE,
                                  cuda_driver.STREAM_WAIT_VALUE_AND)
        cuda_driver.stream_write32(stream, self._dbase + _DONE_AT, 0)

    # On the host --------------------------------------------------------------------------

    def failed_calls(self):
        """Calls verifyd answered with an error, since the channel opened."""
        return int(self._words[_FAILED_AT // 4])

    def last_response(self):
        """The VerifyResponse of the last call served (timing, served path, error)."""
        n = int(self._words[_RESPONSE_BYTES_AT // 4])
        resp = verify_pb2.VerifyResponse()
        resp.ParseFromString(bytes(self._shm.buf[self._response_at:self._response_at + n]))
        return resp

    def _gone(self):
        """verifyd closed the channel, or its process exited: no one will answer a ring."""
        if self._words[_STATE_AT // 4] != _STATE_OPEN:
            return True
        # /proc, not kill(pid, 0): verifyd usually runs as another user.
        return self._verifyd is not None and not os.path.exists(f"/proc/{self._verifyd}")

    def _watch(self):
        """A stream waiting on a call that verifyd will never answer (verifyd exited or closed
        the channel) would wait forever: answer its ring with UNAVAILABLE instead, so the graph
        goes on (its o is left as it was) and check() raises. A verifyd that is alive but slow
        is never answered for: its late answer would land on a later call."""
        words = self._words
        while not self._watch_stop.wait(0.05):
            if not self._gone():
                continue
            # A ring verifyd never took, or one it took before it went: either way the stream
            # waits for the done word (and resets it after each call, so it is set again here).
            words[_DOORBELL_AT // 4] = 0
            if words[_DONE_AT // 4] == 0:
                self.released += 1
                words[_DONE_AT // 4] = _DONE | _UNAVAILABLE << 8

    def check(self):
        """Raises VerifydError when a call failed since the last check (after synchronising the
        stream that made them): the last failure's status and message."""
        failed = self.failed_calls()
        if failed != self._failed_seen:
            n, self._failed_seen = failed - self._failed_seen, failed
            r = self.last_response()
            code = status_code(r.error_code) if r.error_code else grpc.StatusCode.UNKNOWN
            raise VerifydError(code, f"channel '{self.name}': {n} call(s) failed; the last "
                                     f"answer: {r.error_message or 'see verifyd log'}")
        if self.released:
            raise VerifydError(grpc.StatusCode.UNAVAILABLE,
                               f"channel '{self.name}': verifyd is gone; {self.released} call(s) "
                               f"were released unanswered (their o is stale): open a new channel")
        if self._words[_STATE_AT // 4] != _STATE_OPEN:
            raise VerifydError(grpc.StatusCode.UNAVAILABLE, f"channel '{self.name}': closed")

    def close(self):
        """Closes the channel at verifyd and frees the shared memory. The stream must have no
        call of this channel left to run."""
        if self._open:
            self._open = False
            close_channel(self._stub, self.name, self.timeout)
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            self._watch_stop.set()
            watchdog.join()
            self._watchdog = None
        self._words = self._shm = None
        self._mem.free()


def _verifyd_process(target):
    """The pid of the process listening on a Unix socket target (SO_PEERCRED), or None."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            path = target[len(prefix):]
            break
    else:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
            return pid
    except OSError:
        return None


class VerifyStep:
    """A serving stack's verify attention through one doorbell channel: one descriptor per layer
    (its KV pool), and static q, o, kv_indices and tree_mask buffers of the largest shapes that
    every layer shares. Per forward pass ``set_layout`` (once), then per layer
    ``attend(layer, q, o)``; everything is enqueued on the current stream, and capturable.
    The pools are bf16 or torch.float8_e4m3fn; ``kv_scales``: each e4m3 pool's scale, one per
    layer (None: 1 for every layer)."""

    def __init__(self, client, kv_pools, max_batch, draft, heads, max_indices, sm_scale,
                 mask_format="bytes", layout_slots=2, kv_scales=None):
        torch = _torch()
        device = kv_pools[0].device
        rows = max_batch * draft
        mask_cols = draft if mask_format == "bytes" else -(-draft // 8)
        with torch.cuda.device(device):
            self.q = torch.zeros(rows, heads, HEAD_DIM_QK, dtype=torch.bfloat16, device=device)
            self.o = torch.zeros(rows, heads, HEAD_DIM_V, dtype=torch.bfloat16, device=device)
            self.kv_indices = torch.zeros(max_indices, dtype=torch.int32, device=device)
            self.tree_mask = torch.zeros(max_batch, draft, mask_cols, dtype=torch.uint8,
                                         device=device)
        self.draft, self.heads, self.max_batch = draft, heads, max_batch
        self._batch = None
        if kv_scales is None:
            kv_scales = [None] * len(kv_pools)
        if len(kv_scales) != len(kv_pools):
            raise InvalidBundleError(f"kv_scales: {len(kv_scales)} scales for {len(kv_pools)} "
                                     f"kv_pools (one per layer)")
        descriptors = [Descriptor(self.q, pool, self.kv_indices, self.tree_mask, self.o, sm_scale,
                                  mask_format=mask_format, kv_scale=scale)
                       for pool, scale in zip(kv_pools, kv_scales)]
        self.channel = DoorbellChannel(client, descriptors, layout_slots)

    def set_layout(self, kv_indptr, kv_indices, kv_lens, tree_mask, slot=0):
        """The forward pass's layout: kv_indptr [B+1], kv_indices (at least kv_indptr[B]
        entries, at most max_indices), kv_lens [B] (prefix + T), tree_mask [B, T, ...], all on
        the device. Copied into the static buffers on the stream."""
        b = int(kv_lens.shape[0])
        n = int(kv_indices.shape[0])
        if n > self.kv_indices.shape[0]:
            raise InvalidBundleError(f"kv_indices: {n} entries, the step holds "
                                     f"{int(self.kv_indices.shape[0])} (max_indices)")
        if tuple(tree_mask.shape[1:]) != tuple(self.tree_mask.shape[1:]) or tree_mask.shape[0] != b:
            raise InvalidBundleError(f"tree_mask: shape {list(tree_mask.shape)}, expected "
                                     f"[{b}, {', '.join(map(str, self.tree_mask.shape[1:]))}]")
        self.kv_indices[:n].copy_(kv_indices)
        self.tree_mask[:b].copy_(tree_mask)
        self.channel.set_layout(kv_indptr, kv_lens, slot=slot)
        self._batch = b

    def attend(self, layer, q, o=None, slot=0):
        """Layer ``layer``'s verify attention: q [B*T, H, 576] or [B*T, H*576]; writes o
        [B*T, H, 512] (or [B*T, H*512]) when given, else returns a view of the static output
        (valid until the next call)."""
        if self._batch is None:
            raise InvalidBundleError("set_layout: call it before the first attend")
        rows = self._batch * self.draft
        if int(q.shape[0]) != rows or math.prod(q.shape[1:]) != self.heads * HEAD_DIM_QK:
            raise InvalidBundleError(f"q: shape {list(q.shape)}, expected [{rows}, {self.heads}, "
                                     f"{HEAD_DIM_QK}] or [{rows}, {self.heads * HEAD_DIM_QK}]")
        self.q[:rows].copy_(q.reshape(rows, self.heads, HEAD_DIM_QK))
        self.channel.call(layer, slot)
        out = self.o[:rows]
        if o is None:
            return out
        o.view(rows, self.heads, HEAD_DIM_V).copy_(out)
        return o

    def close(self):
        self.channel.close()


__all__ = ["Descriptor", "DoorbellChannel", "VerifyStep", "ring_word"]
