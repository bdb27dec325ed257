"""The CUDA driver calls the cuda_ipc transport needs, through ctypes (libcuda.so.1).

torch's own handle (``untyped_storage()._share_cuda_()[1]``) is not a bare cudaIpcMemHandle_t:
it is 66 bytes, a version byte and a type byte ('c' for a cudaMalloc block, 'e' for an
expandable segment, which CUDA IPC handles cannot export) before the 64-byte handle, and
asking for it turns the storage into one shared through torch.multiprocessing. The driver gives
the bare handle and the allocation's range directly.
"""

import ctypes
import threading

IPC_HANDLE_BYTES = 64

_CU_POINTER_ATTRIBUTE_CONTEXT = 1
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12

_NOT_EXPORTABLE = ("cuda_ipc: this allocation cannot be exported through a CUDA IPC handle "
                   "(only cudaMalloc memory can; torch's "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True allocations cannot)")

_lib = None
_lock = threading.Lock()

# CUDA VMM (cuMemCreate) allocations, as torch's expandable segments make them.
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location_type", ctypes.c_int), ("location_id", ctypes.c_int),
                ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CudaDriverError(RuntimeError):
    pass


def _driver():
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise CudaDriverError(f"cuda_ipc: cannot load the CUDA driver (libcuda.so.1): "
                                      f"{e}") from None
            lib.cuInit.argtypes = [ctypes.c_uint]
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
            lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
            lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                         ctypes.c_void_p, ctypes.c_uint]
            for fn in (lib.cuStreamWriteValue32_v2, lib.cuStreamWaitValue32_v2):
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                                 ctypes.c_void_p]
            lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                        ctypes.c_void_p]
            lib.cuMemRelease.argtypes = [ctypes.c_uint64]
            lib.cuMemGetAllocationPropertiesFromHandle.argtypes = [
                ctypes.POINTER(_AllocationProp), ctypes.c_uint64]
            lib.cuMemGetAllocationGranularity.argtypes = [
                ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_AllocationProp), ctypes.c_int]
            lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64,
                                                         ctypes.c_int, ctypes.c_ulonglong]
            _check(lib, lib.cuInit(0), "cuInit")
            _lib = lib
        return _lib


def _check(lib, rc, what):
    if rc != 0:
        s = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(s))
        why = s.value.decode() if s.value else "unknown error"
        raise CudaDriverError(f"{what}: CUDA error {rc} ({why})")


def _attribute(lib, ctype, attribute, ptr, what):
    v = ctype()
    _check(lib, lib.cuPointerGetAttribute(ctypes.byref(v), attribute, ptr), what)
    return v.value


def allocation(ptr):
    """(base, size, device) of the device allocation (cudaMalloc block) holding ``ptr``."""
    lib = _driver()
    base = _attribute(lib, ctypes.c_uint64, _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr,
                      "cuPointerGetAttribute(RANGE_START_ADDR)")
    size = _attribute(lib, ctypes.c_size_t, _CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr,
                      "cuPointerGetAttribute(RANGE_SIZE)")
    device = _attribute(lib, ctypes.c_int, _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr,
                        "cuPointerGetAttribute(DEVICE_ORDINAL)")
    return base, size, device


def ipc_handle(base):
    """The 64 bytes of the cudaIpcMemHandle_t of the allocation starting at ``base``."""
    lib = _driver()
    ctx = _attribute(lib, ctypes.c_void_p, _CU_POINTER_ATTRIBUTE_CONTEXT, base,
                     "cuPointerGetAttribute(CONTEXT)")
    _check(lib, lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        handle = (ctypes.c_char * IPC_HANDLE_BYTES)()
        rc = lib.cuIpcGetMemHandle(ctypes.byref(handle), base)
        if rc != 0:
            try:
                _check(lib, rc, "cuIpcGetMemHandle")
            except CudaDriverError as e:
                raise CudaDriverError(f"{e}: {_NOT_EXPORTABLE}") from None
        return bytes(handle)
    finally:
        popped = ctypes.c_void_p()
        lib.cuCtxPopCurrent_v2(ctypes.byref(popped))


# Stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32): enqueued on a stream,
# so a CUDA graph captures them. The default write is preceded by a system-wide memory fence.
STREAM_WAIT_VALUE_AND = 0x2  # CU_STREAM_WAIT_VALUE_AND: until (*addr & value) != 0


def host_device_pointer(host_ptr):
    """The device address of registered (cudaHostRegisterMapped) host memory at ``host_ptr``."""
    lib = _driver()
    d = ctypes.c_uint64()
    _check(lib, lib.cuMemHostGetDevicePointer_v2(ctypes.byref(d), host_ptr, 0),
           "cuMemHostGetDevicePointer")
    return d.value


def stream_write32(stream, address, value):
    lib = _driver()
    _check(lib, lib.cuStreamWriteValue32_v2(stream, address, value, 0), "cuStreamWriteValue32")


def stream_wait32(stream, address, value, flags):
    lib = _driver()
    _check(lib, lib.cuStreamWaitValue32_v2(stream, address, value, flags), "cuStreamWaitValue32")


def copy_to_host_async(host_ptr, device_ptr, nbytes, stream):
    lib = _driver()
    _check(lib, lib.cuMemcpyDtoHAsync_v2(host_ptr, device_ptr, nbytes, stream),
           "cuMemcpyDtoHAsync")


# CUDA VMM allocations ---------------------------------------------------------------------------
# torch's expandable segments reserve one address range and map physical chunks (cuMemCreate,
# 20 MB each) into it as the segment grows. cuIpcGetMemHandle refuses them; each chunk is
# exported to a POSIX file descriptor instead, and verifyd maps the chunks side by side again.


def _retain(lib, address):
    """The allocation handle of the chunk mapped at ``address`` (retained), or None."""
    h = ctypes.c_uint64()
    if lib.cuMemRetainAllocationHandle(ctypes.byref(h), address) != 0:
        return None
    return h.value


def is_vmm(ptr):
    """Whether ``ptr`` lies in a VMM (cuMemCreate) allocation, such as torch's expandable
    segments make."""
    lib = _driver()
    h = _retain(lib, ptr)
    if h is None:
        return False
    lib.cuMemRelease(h)
    return True


def _same_chunk(lib, address, handle):
    """Whether the chunk mapped at ``address`` is ``handle``'s (None: nothing VMM is mapped)."""
    h = _retain(lib, address)
    if h is None:
        return None
    lib.cuMemRelease(h)
    return h == handle


def vmm_chunks(ptr, nbytes):
    """The physical chunks behind [ptr, ptr + nbytes) of a VMM allocation: a list of
    (address, size, handle), each handle retained (release them with release_handles), in
    address order, the first starting at or before ptr and the last ending at or after its end.
    Found by asking for the allocation handle at each granularity step: a chunk is the run of
    steps with one handle."""
    lib = _driver()
    first = _retain(lib, ptr)
    if first is None:
        raise CudaDriverError("cuda_ipc: the tensor is not in a VMM (cuMemCreate) allocation")
    chunks = []
    try:
        prop = _AllocationProp()
        _check(lib, lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), first),
               "cuMemGetAllocationPropertiesFromHandle")
        if not prop.requestedHandleTypes & _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            raise CudaDriverError(
                "cuda_ipc: this VMM allocation was not created exportable to a POSIX file "
                "descriptor (requestedHandleTypes lacks CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)")
        g = ctypes.c_size_t()
        _check(lib, lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop),
                                                      _CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity")
        step = g.value
        start = ptr - ptr % step
        while start >= step and _same_chunk(lib, start - step, first):
            start -= step
        end = ptr + nbytes
        handle, at = first, start
        first = None  # owned by chunks from here
        while True:
            stop = at + step
            while _same_chunk(lib, stop, handle):
                stop += step
            chunks.append((at, stop - at, handle))
            if stop >= end:
                return chunks
            handle = _retain(lib, stop)
            if handle is None:
                raise CudaDriverError(f"cuda_ipc: nothing is mapped at {stop:#x}, inside the "
                                      f"tensor's bytes")
            at = stop
    except BaseException:
        if first is not None:
            lib.cuMemRelease(first)
        release_handles(chunks)
        raise


def release_handles(chunks):
    lib = _driver()
    for _, _, h in chunks:
        lib.cuMemRelease(h)


def export_fd(handle):
    """A POSIX file descriptor of the chunk ``handle`` (the caller closes it)."""
    lib = _driver()
    fd = ctypes.c_int(-1)
    _check(lib, lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle,
                                                 _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)")
    return fd.value
