"""transport="shm": tensors in the client's own POSIX shared memory, named by reference.

The client creates its shared-memory objects (multiprocessing.shared_memory, shared with the
group of verifyd's socket: _shm.py), registers each once as a region and unregisters and unlinks
them on close(). Inputs that already live in one of them (a pool from ``register_kv_pool`` or
``shm_array``) are named in place; the others are copied into the call's staging slot, where
verifyd also writes o (and lse).
"""

import itertools
import math

import grpc
import numpy as np

from . import _shm, tensors
from ._proto import types_pb2
from .bundle import HEAD_DIM_QK, check_call, compact_pool
from .errors import InvalidBundleError, VerifydError
from .regions import OFFSET_GRID, ref
from .result import inline_outputs, make_result, to_torch
from .staging import Layout, SlotRing
from .transport import SlotPending, Transport


class ShmRegion:
    """One shared-memory object of the client's, registered with verifyd as region ``name``."""

    def __init__(self, calls, name, size, client, target):
        self._calls = calls
        self.name = name
        self.size = size
        self._shm = _shm.create(size, target)
        self.key = "/" + self._shm.name.lstrip("/")  # shm_open's name
        self._bytes = np.frombuffer(self._shm.buf, dtype=np.uint8)
        self.address = self._bytes.__array_interface__["data"][0]
        try:
            calls.register_shm(name, self.key, 0, size, client)
        except BaseException:
            self._free()
            raise
        self._registered = True

    def array(self, offset, dtype, shape):
        """A numpy view of ``shape`` elements of ``dtype`` at ``offset``."""
        n = math.prod(shape) * np.dtype(dtype).itemsize
        return self._bytes[offset:offset + n].view(dtype).reshape(shape)

    def offset_of(self, address, nbytes):
        """Where [address, address + nbytes) lies in this region, or None."""
        off = address - self.address
        return off if 0 <= off and off + nbytes <= self.size else None

    def close(self, unregister=True):
        """Unregisters (verifyd waits for calls using it) and unlinks the object."""
        if self._registered and unregister:
            self._registered = False
            try:
                self._calls.unregister(name=self.name)
            except VerifydError as e:
                if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    self._free()
                    raise
        self._free()

    def retire(self):
        """close(): verifyd's unregister waits for the calls still using the region."""
        self.close()

    def _free(self):
        if self._shm is None:
            return
        self._bytes = None
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        try:
            self._shm.close()
        except BufferError:
            # The caller still holds arrays of it: they keep the mmap object, so the mapping
            # goes with the last of them. Drop it here so SharedMemory does not retry (and
            # complain) when it is collected; close() then closes the descriptor.
            self._shm._mmap = None  # noqa: SLF001
            self._shm.close()
        self._shm = None


def _host_span(x):
    """(address, nbytes) of a C-contiguous host numpy array or CPU torch tensor, else None."""
    if tensors.is_torch(x):
        if x.device.type != "cpu" or not x.is_contiguous():
            return None
        return x.data_ptr(), x.numel() * x.element_size()
    a = np.asarray(x)
    if not a.flags.c_contiguous:
        return None
    return a.__array_interface__["data"][0], a.nbytes


class _ShmPending(SlotPending):
    def decode(self, resp):
        try:
            if resp.o.raw_contents:  # verifyd answered inline after all
                o, lse = inline_outputs(resp)
            else:
                o = self._slot.array(self._o_at[0], np.uint16, self._o_at[1]).copy()
                lse = None
                if self._lse_at is not None:
                    lse = self._slot.array(self._lse_at[0], np.float32, self._lse_at[1]).copy()
        finally:
            self.release()
        if self.torch_device is not None:
            o, lse = to_torch(o, lse, self.torch_device)
        return make_result(resp, o, lse)


class ShmTransport(Transport):
    kind = "shm"

    def __init__(self, calls, client, staging_slots, target):
        self._calls = calls
        self._client = client
        self._target = target
        self._names = itertools.count()
        self._regions = []  # the client's arrays and pools, registered
        self._ring = SlotRing(lambda n: self._new_region("slot", n), staging_slots)

    def _new_region(self, what, size):
        return ShmRegion(self._calls, f"{self._client}/{what}{next(self._names)}", size,
                         self._client, self._target)

    def shm_array(self, shape, dtype=np.uint16):
        """A zeroed numpy array in a new registered region of the client's; calls name it in
        place (no copy) when it is passed as an input."""
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        region = self._new_region("array", max(nbytes, 1))
        self._regions.append(region)
        return region.array(0, dtype, shape)

    def register_kv_pool(self, pool):
        """A copy of ``pool`` ([num_pages, page_size, 576] of bf16, or of e4m3: torch
        float8_e4m3fn or numpy uint8 bits) in the client's shared memory; pass the returned array
        (a CPU torch tensor of the pool's dtype for a torch pool) as kv_pool, with the pool's
        kv_scale for e4m3, and write new pages into it in place."""
        bits = tensors.kv_bits("kv_pool", pool)
        if bits.ndim != 3 or bits.shape[2] != HEAD_DIM_QK:
            raise InvalidBundleError(f"kv_pool: shape {list(bits.shape)}, expected "
                                     f"[num_pages, page_size, {HEAD_DIM_QK}]")
        dst = self.shm_array(bits.shape, bits.dtype)
        dst[...] = bits
        if tensors.is_torch(pool):
            import torch  # noqa: PLC0415 - present whenever pool is a tensor

            if bits.dtype == np.uint8:
                return torch.from_numpy(dst).view(torch.float8_e4m3fn)
            return torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16)
        return dst

    def _locate(self, x):
        """(region, offset) when x's memory lies in one of the client's regions, else None."""
        span = _host_span(x)
        if span is None:
            return None
        for region in self._regions:
            off = region.offset_of(*span)
            if off is not None and off % OFFSET_GRID == 0:  # else staged like any other array
                return region, off
        return None

    def encode(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale, want_lse,
               request_id, compact, device, compare_sync, mask_format, kv_scale=None):
        b = check_call(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                       mask_format=mask_format, kv_scale=kv_scale)
        refs = {}
        pool_at = self._locate(kv_pool)
        if pool_at is not None:  # the registered pool, whole and in place
            b.kv_pool = tensors.kv_bits("kv_pool", kv_pool)
        else:
            compact_pool(b, kv_pool, compact)
        b.q = tensors.bf16_bits("q", q)
        layout = Layout()
        copies = []
        for name, dtype, a in b.inputs():
            at = pool_at if name == "kv_pool" else self._locate(a)
            if at is not None:
                refs[name] = ref("shm", at[0].name, at[1], dtype, a.shape)
            else:
                copies.append((name, dtype, a, layout.add(name, a.nbytes)))
        o_shape, lse_shape = b.o_shape(), b.lse_shape()
        o_at = (layout.add("o", math.prod(o_shape) * 2), o_shape)
        lse_at = (layout.add("lse", math.prod(lse_shape) * 4), lse_shape) if want_lse else None
        slot = self._ring.acquire(layout.size)
        try:
            for name, dtype, a, off in copies:
                slot.array(off, a.dtype, a.shape)[...] = a
                refs[name] = ref("shm", slot.name, off, dtype, a.shape)
            refs["o_out"] = ref("shm", slot.name, o_at[0], types_pb2.DTYPE_BF16, o_shape)
            if lse_at is not None:
                refs["lse_out"] = ref("shm", slot.name, lse_at[0], types_pb2.DTYPE_F32, lse_shape)
            req = b.to_request(want_lse=want_lse, request_id=request_id,
                               device=0 if device is None else device,
                               compare_sync=compare_sync, refs=refs)
        except BaseException:
            self._ring.release(slot)
            raise
        return req, _ShmPending(self._ring, slot, o_at, lse_at,
                                q.device if tensors.is_torch(q) else None)

    def close(self):
        """Unregisters every region of this client at once, then unlinks them."""
        try:
            self._calls.unregister_client(self._client)
        finally:
            self._ring.close(unregister=False)
            for region in self._regions:
                region.close(unregister=False)
            self._regions = []
