"""transport="cuda_ipc": torch CUDA tensors named in place through CUDA IPC handles.

verifyd opens a handle of a whole device allocation (a cudaMalloc block; torch's caching
allocator hands out pieces of such blocks), so the client registers allocations, not tensors:
one region per allocation, found by the tensor's address, registered on first use and kept
until close(). The client keeps a reference to a tensor in every registered allocation, so the
allocation cannot be freed and reused while verifyd maps it.

A tensor in a VMM allocation (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which CUDA IPC
handles cannot export, is registered as its own region instead: the physical chunks behind its
bytes are exported to file descriptors, passed on verifyd's descriptor socket (vmm_fds), and
verifyd maps them side by side (RegisterCudaVmmRegion). The region starts at the tensor.

A list of tensors, e.g. a KV pool per layer, is registered as one region set instead
(register_set, RegisterCudaRegionSet): each member is a CUDA IPC or a VMM allocation, picked per
tensor as above, and starts at its tensor; a tensor inside a member is named by (set, index).

Per call: the KV pool (registered once) and q when it lives in a buffer registered with
register_buffer are named in place; otherwise q is copied into a staging slot on the device. verifyd writes o (and
lse) into the slot; the result is a copy of it on q's device, never through the host. Index
tensors and the mask travel inline. Before sending, the client synchronizes the current stream
of q's device, so the writes that produced q and the pool are complete.
"""

import itertools
import math
import os
import threading

import grpc

from . import cuda_driver, tensors, vmm_fds
from . import tensors as tensors_module
from ._proto import types_pb2
from .bundle import HEAD_DIM_QK, check_call
from .errors import InvalidBundleError, VerifydError
from .regions import OFFSET_GRID, PoolSet, ref, set_ref
from .result import inline_outputs, make_result, to_torch
from .staging import Layout, SlotRing
from .transport import SlotPending, Transport


def _torch():
    try:
        import torch  # noqa: PLC0415 - the transport needs it, the package does not
    except ImportError:
        raise ImportError("transport 'cuda_ipc' needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise RuntimeError("transport 'cuda_ipc': torch sees no CUDA device")
    return torch


class _Allocation:
    """One registered device allocation: region ``name`` over [base, base + size)."""

    def __init__(self, name, base, size, device):
        self.name, self.base, self.size, self.device = name, base, size, device
        self.keep = {}  # id -> tensor living in it; the allocation stays while any does
        self.spans = {}  # id -> (ptr, nbytes) of the kept tensors inputs may be named in


class _Set:
    """One registered region set: member i is [spans[i][0], + spans[i][1]) of ``tensors[i]``."""

    def __init__(self, name, device, tensors, spans):
        self.name, self.device, self.tensors, self.spans = name, device, tensors, spans


def _ref(at, dtype, shape):
    """A cuda_ipc Tensor at ``at``: (region, offset), or ("", offset, set, index)."""
    if len(at) == 4:
        return set_ref(at[2], at[3], at[1], dtype, shape, kind="cuda_ipc")
    return ref("cuda_ipc", at[0], at[1], dtype, shape)


class _Slot:
    """A staging buffer on one device (uint8), in a registered allocation."""

    def __init__(self, transport, device, size):
        torch = _torch()
        self._transport = transport
        self.size = size
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.region, self.offset = transport.register(self.buffer, named=False)
        self.done = None  # an event after the last copy out of the slot

    def view(self, offset, dtype, shape):
        torch = _torch()
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + n].view(dtype).view(shape)

    def close(self, unregister=True):
        self._transport.forget(self.buffer, unregister)
        self.buffer = None

    def retire(self):
        """verifyd may still write into the buffer: it is kept (not returned to torch's
        allocator) until the client closes, when the unregister waits for verifyd's calls."""
        self._transport.retired.append(self.buffer)
        self.buffer = None


class _CudaPending(SlotPending):
    def decode(self, resp):
        torch = _torch()
        try:
            if resp.o.raw_contents:  # verifyd answered inline after all
                o, lse = to_torch(*inline_outputs(resp), self.torch_device)
            else:
                with torch.cuda.device(self.torch_device):
                    o = self._slot.view(self._o_at[0], torch.bfloat16, self._o_at[1]).clone()
                    lse = None
                    if self._lse_at is not None:
                        lse = self._slot.view(self._lse_at[0], torch.float32,
                                              self._lse_at[1]).clone()
                    self._slot.done = torch.cuda.Event()
                    self._slot.done.record()
        finally:
            self.release()
        return make_result(resp, o, lse)


class CudaIpcTransport(Transport):
    kind = "cuda_ipc"

    def __init__(self, calls, client, staging_slots, target=None):
        _torch()
        self._fds_path = vmm_fds.socket_path(target)
        self._calls = calls
        self._client = client
        self._names = itertools.count()
        self._allocations = {}  # (device, base) -> _Allocation
        self._sets = {}  # name -> _Set
        self._lock = threading.RLock()
        self._slots = staging_slots
        self._rings = {}  # device index -> SlotRing
        self.retired = []  # staging buffers of abandoned calls, kept until close()

    # Allocations -------------------------------------------------------------------------

    def register(self, t, named=True):
        """(region, offset) of tensor ``t``'s memory; registers its allocation the first time
        and keeps ``t`` alive with it. Inputs inside a ``named`` tensor are named in place."""
        ptr = t.data_ptr()
        nbytes = t.numel() * t.element_size()
        with self._lock:  # held over the call: one region per allocation, however many threads
            a = self._containing(t.device.index, ptr, nbytes)
            if a is None:
                a = self._register_allocation(t, ptr, nbytes)
                self._allocations[(a.device, a.base)] = a
            a.keep[id(t)] = t
            if named:
                a.spans[id(t)] = (ptr, nbytes)
        return a.name, ptr - a.base

    def _containing(self, device, ptr, nbytes):
        for (d, base), a in self._allocations.items():
            if d == device and base <= ptr and ptr + nbytes <= base + a.size:
                return a
        return None

    def _register_allocation(self, t, ptr, nbytes):
        """Registers the allocation holding ``t``: a CUDA IPC handle of its cudaMalloc block, or
        for a VMM allocation the chunks behind ``t``'s bytes."""
        name = f"{self._client}/cuda{next(self._names)}"
        try:
            base, size, device = cuda_driver.allocation(ptr)
            handle = cuda_driver.ipc_handle(base)
        except cuda_driver.CudaDriverError:
            if not cuda_driver.is_vmm(ptr):
                raise
            return self._register_vmm(name, t, ptr, nbytes)
        self._calls.register_cuda(name, handle, device, size, self._client)
        return _Allocation(name, base, size, device)

    def _register_vmm(self, name, t, ptr, nbytes):
        torch = _torch()
        if self._fds_path is None:
            raise InvalidBundleError(
                "cuda_ipc: a tensor in a VMM allocation (torch's expandable segments) is passed "
                "to verifyd as file descriptors, over its Unix socket only; connect to "
                "unix:PATH")
        device = t.device.index
        with torch.cuda.device(device):
            chunks = cuda_driver.vmm_chunks(ptr, nbytes)
            fds = []
            try:
                for _, _, handle in chunks:
                    fds.append(cuda_driver.export_fd(handle))
            finally:
                cuda_driver.release_handles(chunks)
        token = vmm_fds.new_token()
        try:
            vmm_fds.send(self._fds_path, token, fds)
        finally:
            for fd in fds:
                os.close(fd)
        self._calls.register_cuda_vmm(name, token, [size for _, size, _ in chunks], device,
                                      ptr - chunks[0][0], nbytes, self._client)
        return _Allocation(name, ptr, nbytes, device)

    def forget(self, t, unregister=True):
        """Drops the reference to ``t``; an allocation left with none is unregistered."""
        with self._lock:
            for key, a in list(self._allocations.items()):
                a.spans.pop(id(t), None)
                if a.keep.pop(id(t), None) is not None and not a.keep:
                    del self._allocations[key]
                    break
            else:
                return
        if unregister:
            try:
                self._calls.unregister(name=a.name)
            except VerifydError as e:
                if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    raise

    def register_set(self, name, tensors):
        """Registers ``tensors`` (CUDA, contiguous, on one GPU) as region set ``name``, member i
        starting at tensors[i]: a CUDA IPC member for cudaMalloc memory, a VMM member (its
        chunks' descriptors sent under one token for the whole set) for an expandable segment.
        Returns a PoolSet; tensors inside a member are then named by (set, index)."""
        torch = _torch()
        tensors = list(tensors)
        if not tensors:
            raise InvalidBundleError("tensors: a region set needs at least one tensor")
        device, members, kinds, spans, fds = None, [], [], [], []
        try:
            for i, t in enumerate(tensors):
                field = f"tensors[{i}]"
                if not (tensors_module.is_torch(t) and t.is_cuda):
                    raise InvalidBundleError(f"{field}: expected a torch CUDA tensor, not "
                                             f"{type(t).__name__}")
                if not t.is_contiguous():
                    raise InvalidBundleError(f"{field}: must be contiguous to be named in place")
                ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
                if nbytes == 0:
                    raise InvalidBundleError(f"{field}: has no bytes")
                if device is None:
                    device = t.device.index
                elif t.device.index != device:
                    raise InvalidBundleError(f"{field}: on {t.device}, tensors[0] on cuda:"
                                             f"{device}; a set's members live on one GPU")
                with torch.cuda.device(device):
                    if cuda_driver.is_vmm(ptr):
                        chunks = cuda_driver.vmm_chunks(ptr, nbytes)
                        try:
                            for _, _, handle in chunks:
                                fds.append(cuda_driver.export_fd(handle))
                        finally:
                            cuda_driver.release_handles(chunks)
                        members.append({"chunks": [size for _, size, _ in chunks],
                                        "offset": ptr - chunks[0][0], "byte_size": nbytes})
                        kinds.append("vmm")
                    else:
                        base = cuda_driver.allocation(ptr)[0]
                        members.append({"ipc_handle": cuda_driver.ipc_handle(base),
                                        "offset": ptr - base, "byte_size": nbytes})
                        kinds.append("cuda_ipc")
                if members[-1]["offset"] % OFFSET_GRID:
                    raise InvalidBundleError(
                        f"{field}: starts {members[-1]['offset']} bytes into its allocation, "
                        f"not a multiple of {OFFSET_GRID}; verifyd reads members in place with "
                        f"{OFFSET_GRID}-byte loads")
                spans.append((ptr, nbytes))
            token = b""
            if fds:
                if self._fds_path is None:
                    raise InvalidBundleError(
                        "tensors: members in VMM allocations (torch's expandable segments) are "
                        "passed to verifyd as file descriptors, over its Unix socket only; "
                        "connect to unix:PATH")
                token = vmm_fds.new_token()
                vmm_fds.send(self._fds_path, token, fds)
        finally:
            for fd in fds:
                os.close(fd)
        info = self._calls.register_cuda_set(name, members, device, token, self._client)
        with self._lock:
            self._sets[name] = _Set(name, device, tensors, spans)
        return PoolSet(name, tensors, kinds, info)

    def forget_set(self, name):
        """Unregisters set ``name`` and drops the tensors kept for it."""
        with self._lock:
            self._sets.pop(name, None)
        try:
            return self._calls.unregister(name=name)
        except VerifydError as e:
            if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                raise
        return []

    def _locate(self, t):
        """Where t's bytes lie when in a registered set's member ("", offset, set, index), pool
        or buffer (region, offset), else None."""
        if not t.is_contiguous():
            return None
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        with self._lock:
            for s in self._sets.values():
                if s.device != t.device.index:
                    continue
                for i, (start, size) in enumerate(s.spans):
                    if start <= ptr and ptr + n <= start + size:
                        off = ptr - start
                        return ("", off, s.name, i) if off % OFFSET_GRID == 0 else None
            for (device, base), a in self._allocations.items():
                if device != t.device.index:
                    continue
                for start, size in a.spans.values():
                    if start <= ptr and ptr + n <= start + size:
                        # off verifyd's offset grid it is staged like any other tensor
                        return (a.name, ptr - base) if (ptr - base) % OFFSET_GRID == 0 else None
        return None

    def register_kv_pool(self, pool):
        """Registers the allocation holding ``pool`` (CUDA bf16 or float8_e4m3fn
        [num_pages, page_size, 576], contiguous) and returns ``pool``; calls name it in place."""
        _cuda_pool(pool)
        if len(pool.shape) != 3 or int(pool.shape[2]) != HEAD_DIM_QK:
            raise InvalidBundleError(f"kv_pool: shape {list(pool.shape)}, expected "
                                     f"[num_pages, page_size, {HEAD_DIM_QK}]")
        if not pool.is_contiguous():
            raise InvalidBundleError("kv_pool: must be contiguous to be named in place")
        _check_pool_offset(pool)
        self.register(pool)
        return pool

    def register_buffer(self, t):
        """Registers the allocation holding CUDA tensor ``t`` (e.g. a q buffer the caller writes
        each step); inputs that live in it are then named in place. Returns ``t``."""
        if not (tensors.is_torch(t) and t.is_cuda):
            raise InvalidBundleError("register_buffer: expected a torch CUDA tensor")
        self.register(t)
        return t

    # Calls -------------------------------------------------------------------------------

    def _ring(self, device):
        with self._lock:
            ring = self._rings.get(device.index)
            if ring is None:
                ring = SlotRing(lambda n: _Slot(self, device, n), self._slots)
                self._rings[device.index] = ring
        return ring

    def encode(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale, want_lse,
               request_id, compact, device, compare_sync, mask_format, kv_scale=None):
        torch = _torch()
        _cuda_bf16("q", q)
        _cuda_pool(kv_pool)
        dev = q.device
        if kv_pool.device != dev:
            raise InvalidBundleError(f"kv_pool: on {kv_pool.device}, q on {dev}; verifyd reads "
                                     f"both on one GPU")
        if device is not None and device != dev.index:
            raise InvalidBundleError(f"device: {device}, but q is on {dev} (cuda_ipc tensors "
                                     f"are read on the GPU they live on)")
        b = check_call(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                       mask_format=mask_format, kv_scale=kv_scale)
        pool_at = self._locate(kv_pool)
        if pool_at is None:  # registered on first use, then named in place on every call
            if not kv_pool.is_contiguous():
                raise InvalidBundleError("kv_pool: must be contiguous with transport cuda_ipc")
            _check_pool_offset(kv_pool)
            pool_at = self.register(kv_pool)
        q_at = self._locate(q)
        layout = Layout()
        q_off = layout.add("q", q.numel() * 2) if q_at is None else None
        o_shape, lse_shape = b.o_shape(), b.lse_shape()
        o_at = (layout.add("o", math.prod(o_shape) * 2), o_shape)
        lse_at = (layout.add("lse", math.prod(lse_shape) * 4), lse_shape) if want_lse else None
        ring = self._ring(dev)
        slot = ring.acquire(layout.size)
        try:
            with torch.cuda.device(dev):
                if slot.done is not None:
                    slot.done.synchronize()  # the previous call's o is copied out
                if q_at is None:
                    slot.view(q_off, torch.bfloat16, tuple(q.shape)).copy_(q)
                    q_at = (slot.region, slot.offset + q_off)
                torch.cuda.current_stream(dev).synchronize()
            refs = {
                "q": _ref(q_at, types_pb2.DTYPE_BF16, q.shape),
                "kv_pool": _ref(pool_at, b.kv_pool_dtype(), kv_pool.shape),
                "o_out": ref("cuda_ipc", slot.region, slot.offset + o_at[0],
                             types_pb2.DTYPE_BF16, o_shape),
            }
            if lse_at is not None:
                refs["lse_out"] = ref("cuda_ipc", slot.region, slot.offset + lse_at[0],
                                      types_pb2.DTYPE_F32, lse_shape)
            req = b.to_request(want_lse=want_lse, request_id=request_id, device=dev.index,
                               compare_sync=compare_sync, refs=refs)
        except BaseException:
            ring.release(slot)
            raise
        return req, _CudaPending(ring, slot, o_at, lse_at, dev)

    def close(self):
        """Unregisters every region of this client at once and drops the tensors it kept."""
        try:
            self._calls.unregister_client(self._client)
        finally:
            for ring in self._rings.values():
                ring.close(unregister=False)
            with self._lock:
                self._allocations.clear()
                self._sets.clear()
                self._rings.clear()
                self.retired.clear()


def _check_pool_offset(pool):
    """A pool is read in place, so it must start on verifyd's offset grid in its allocation.
    (A pool in a VMM allocation is a region of its own, which starts at the pool.)"""
    if cuda_driver.is_vmm(pool.data_ptr()):
        return
    offset = pool.data_ptr() - cuda_driver.allocation(pool.data_ptr())[0]
    if offset % OFFSET_GRID != 0:
        raise InvalidBundleError(f"kv_pool: starts {offset} bytes into its CUDA allocation, "
                                 f"not a multiple of {OFFSET_GRID}; verifyd reads the pool in "
                                 f"place with {OFFSET_GRID}-byte loads")


def _cuda_pool(x):
    """A KV pool as cuda_ipc names it: a CUDA tensor of bf16, or of e4m3 (with kv_scale)."""
    _cuda_tensor("kv_pool", x, ("bfloat16", "float8_e4m3fn"))


def _cuda_bf16(name, x):
    _cuda_tensor(name, x, ("bfloat16",))


def _cuda_tensor(name, x, dtypes):
    torch = _torch()
    if not (tensors.is_torch(x) and x.is_cuda):
        raise InvalidBundleError(f"{name}: transport cuda_ipc needs a torch CUDA tensor, not "
                                 f"{type(x).__name__}" + ("" if not tensors.is_torch(x) else
                                                          f" on {x.device}"))
    if x.dtype not in tuple(getattr(torch, d) for d in dtypes):
        raise InvalidBundleError(f"{name}: dtype {x.dtype}, expected "
                                 + " or ".join(f"torch.{d}" for d in dtypes))
