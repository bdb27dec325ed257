"""Calls through a call channel: a shared-memory request slot with a futex doorbell, so a call
needs no gRPC round trip (verify.proto, OpenChannel; the layout is
src/channel/channel_layout.h).

The client creates a POSIX shared-memory object, opens it as a channel, then for each call writes
the serialized VerifyRequest into the request area and its size into the header, increments the
request sequence word and wakes it; verifyd writes the VerifyResponse into the response area and
sets the response sequence word to the request's, waking it. One call at a time per channel.
"""

import ctypes
import itertools
import platform
import time

import grpc
import numpy as np

from ._channel_memory import HEADER_BYTES, ChannelMemory, close_channel
from ._proto import verify_pb2
from .errors import VerifydError, status_code

MAGIC = 0x314E484344594656  # "VFYDCHN1"
MIN_BYTES = HEADER_BYTES + 2 * 4096
# 32-bit words of the header, by byte offset / 4.
_REQUEST_SEQ, _REQUEST_BYTES, _RESPONSE_SEQ, _RESPONSE_BYTES, _STATE = 16, 17, 32, 33, 48
_STATE_OPEN = 1
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_names = itertools.count()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _futex(address, op, value, timeout_s=None):
    ts = None
    if timeout_s is not None:
        ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1) * 1e9)))
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(op),
                  ctypes.c_uint32(value), ts, None, ctypes.c_uint32(0))


class CallChannel:
    """One call channel of a VerifyClient (``client.channel()``): ``verify(...)`` as on the
    client, without a gRPC call. Not thread-safe: one channel per thread that calls.

    byte_size: the shared-memory object (a 4 KiB header and two areas of half the rest each);
    requests and responses larger than an area are refused, so name regions (shm, cuda_ipc) for
    large tensors. spin_s: how long a call spins for its answer before it sleeps on the futex.
    """

    def __init__(self, stub, transport, client_id, byte_size, spin_s, timeout, target):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise NotImplementedError("call channels need x86-64 (its store order publishes "
                                      "the request before the sequence word)")
        if byte_size < MIN_BYTES:
            raise ValueError(f"byte_size: a channel needs at least {MIN_BYTES} bytes")
        self._stub, self._transport, self.timeout = stub, transport, timeout
        self._spin_s = spin_s
        self.name = f"{client_id}-ch{next(_names)}"
        self._mem = ChannelMemory(byte_size, target)
        resp = self._mem.open(stub, timeout, name=self.name, client=client_id)
        self._shm, self._words, self._base = self._mem.shm, self._mem.words, self._mem.base
        self._open = True
        self.capacity = resp.capacity
        self._request_at, self._response_at = resp.request_offset, resp.response_offset
        if int(self._words[:2].view(np.uint64)[0]) != MAGIC:
            self.close()
            raise VerifydError(grpc.StatusCode.INTERNAL, "OpenChannel: no channel header")
        self._seq = 0
        self._broken = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def verify(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
               want_lse=False, request_id=None, compact=True, device=None, compare_sync=False,
               mask_format=None):
        """One call through the channel; arguments and result as VerifyClient.verify."""
        if self._broken is not None:
            raise self._broken
        if not self._open or self._words[_STATE] != _STATE_OPEN:
            raise VerifydError(grpc.StatusCode.UNAVAILABLE, f"channel '{self.name}': closed")
        req, pending = self._transport.encode(q, kv_pool, kv_indptr, kv_indices, kv_lens,
                                              tree_mask, sm_scale, want_lse, request_id,
                                              compact, device, compare_sync, mask_format)
        data = req.SerializeToString()
        if len(data) > self.capacity:
            pending.release()
            raise VerifydError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"channel '{self.name}': the request of {len(data)} bytes does "
                               f"not fit its {self.capacity}-byte area (name regions instead "
                               f"of inline tensors, or open a larger channel)")
        self._shm.buf[self._request_at:self._request_at + len(data)] = data
        self._words[_REQUEST_BYTES] = len(data)
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        self._words[_REQUEST_SEQ] = seq
        _futex(self._base + 4 * _REQUEST_SEQ, _FUTEX_WAKE, 0x7FFFFFFF)
        if not self._await(seq):
            pending.abandon()
            raise self._broken
        n = int(self._words[_RESPONSE_BYTES])
        resp = verify_pb2.VerifyResponse()
        resp.ParseFromString(bytes(self._shm.buf[self._response_at:self._response_at + n]))
        if resp.error_code != 0:
            pending.release()
            raise VerifydError(status_code(resp.error_code), resp.error_message)
        return pending.decode(resp)

    def _await(self, seq):
        spin_end = time.perf_counter() + self._spin_s
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        words = self._words
        while words[_RESPONSE_SEQ] != seq and time.perf_counter() < spin_end:
            pass
        while words[_RESPONSE_SEQ] != seq:
            if words[_STATE] != _STATE_OPEN:
                self._broken = VerifydError(grpc.StatusCode.UNAVAILABLE,
                                            f"channel '{self.name}': closed by verifyd")
                return False
            if deadline is not None and time.monotonic() >= deadline:
                self._broken = VerifydError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"channel '{self.name}': no answer within {self.timeout} s; the channel is "
                    f"unusable now (an answer may still come): open a new one")
                return False
            _futex(self._base + 4 * _RESPONSE_SEQ, _FUTEX_WAIT, (seq - 1) & 0xFFFFFFFF, 0.1)
        return True

    def close(self):
        """Closes the channel at verifyd and frees the shared memory."""
        if self._open:
            self._open = False
            close_channel(self._stub, self.name, self.timeout)
        self._words = self._shm = None
        self._mem.free()


__all__ = ["CallChannel", "MIN_BYTES"]
