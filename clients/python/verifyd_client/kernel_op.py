"""The custom kernel in the serving process: ``VerifyKernel(...).attend(...)`` enqueues one verify-
attention call of libverifyd_kernel.so (kernels/op/verify_op_api.h) on the current stream, with
the contract of a bundle. It allocates nothing per call, never waits for the host, and can be
captured in a CUDA graph.

The library checks each call on the device: the layout, the page ids, the mask and a finite
output. By default the shipped kernel (v5t, on sm_90) makes the checks as it reads, and a call
that fails one may have written part of o; with VERIFYD_OP_CHECKS=separate in the environment
when the op is made, or where the plan is another kernel, check kernels run around the kernel (a
call that fails before the kernel writes nothing). ``VerifyKernel.checks`` says which.
``VerifyKernel.failed`` (a torch.bool tensor of one element on the device, the same tensor every
call) is True after a call that failed a check, False after one that passed: the output of a
failed call must not be served.

    op = VerifyKernel(batch=8, draft=16, heads=16, page_size=64, pool_pages=pool.shape[0],
                      max_indices=kv_indices.numel(), max_kv_len=4096 + 16, sm_scale=0.1352)
    op.attend(q, pool, kv_indptr, kv_indices, kv_lens, tree_mask, o)   # o bf16 [B*T, H, 512]
"""

import ctypes

import grpc

from . import _native
from .bundle import HEAD_DIM_QK, HEAD_DIM_V, checked_kv_scale
from .errors import InvalidBundleError, VerifydError

ABI_VERSION = 4


class _Geometry(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_uint32), ("draft", ctypes.c_uint32),
                ("heads", ctypes.c_uint32), ("page_size", ctypes.c_uint32),
                ("pool_pages", ctypes.c_uint64), ("max_indices", ctypes.c_uint64),
                ("max_kv_len", ctypes.c_uint64), ("mask_bits", ctypes.c_uint32),
                ("want_lse", ctypes.c_uint32), ("sm_scale", ctypes.c_float),
                ("kv_dtype", ctypes.c_uint32), ("kv_scale", ctypes.c_float)]


class _Call(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("kv_pool", ctypes.c_void_p),
                ("kv_indptr", ctypes.c_void_p), ("kv_indices", ctypes.c_void_p),
                ("kv_lens", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("lse", ctypes.c_void_p), ("failed", ctypes.c_void_p)]


def load_library(path=None):
    """libverifyd_kernel.so: ``path``, else $VERIFYD_KERNEL_LIB, else its installed places."""
    p, lib = _native.load("libverifyd_kernel.so", "VERIFYD_KERNEL_LIB", path, "kernels/op/")
    lib.verifyd_op_abi_version.restype = ctypes.c_uint32
    if lib.verifyd_op_abi_version() != ABI_VERSION:
        raise VerifydError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{p}: ABI version {lib.verifyd_op_abi_version()}, this client's "
                           f"{ABI_VERSION}: a library of another verifyd version")
    lib.verifyd_op_create.argtypes = [ctypes.POINTER(_Geometry), ctypes.c_char_p,
                                      ctypes.c_uint32]
    lib.verifyd_op_create.restype = ctypes.c_void_p
    lib.verifyd_op_destroy.argtypes = [ctypes.c_void_p]
    lib.verifyd_op_attend.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Call), ctypes.c_void_p]
    lib.verifyd_op_attend.restype = ctypes.c_int
    lib.verifyd_op_device_bytes.argtypes = [ctypes.c_void_p]
    lib.verifyd_op_device_bytes.restype = ctypes.c_uint64
    lib.verifyd_op_checks_in_kernel.argtypes = [ctypes.c_void_p]
    lib.verifyd_op_checks_in_kernel.restype = ctypes.c_uint32
    lib.verifyd_op_build.restype = ctypes.c_char_p
    return lib


def _torch():
    import torch  # noqa: PLC0415 - the op needs torch with CUDA, the package does not
    return torch


class VerifyKernel:
    """One geometry of the custom kernel on one device (a captured graph serves one batch size):
    B requests of ``draft`` tokens and ``heads`` heads over a pool of ``pool_pages`` pages of
    ``page_size`` tokens, kv_indices of ``max_indices`` entries, no call longer than
    ``max_kv_len`` (prefix + draft). ``mask_format`` "bytes" (uint8 [B, T, T]) or "bits"
    (bit-packed [B, T, ceil(T/8)], little-endian bit order). ``kv_dtype`` "bf16", or "e4m3" for
    a pool of e4m3 codes (torch.float8_e4m3fn or uint8) whose values are e4m3 x ``kv_scale``
    (SGLang's k_scale), read by the kernel as stored (sm_90)."""

    def __init__(self, batch, draft, heads, page_size, pool_pages, max_indices, max_kv_len,
                 sm_scale, mask_format="bytes", want_lse=False, device=None, library=None,
                 kv_dtype="bf16", kv_scale=None):
        torch = _torch()
        if mask_format not in ("bytes", "bits"):
            raise InvalidBundleError(f"mask_format: '{mask_format}', expected 'bytes' or 'bits'")
        if kv_dtype not in ("bf16", "e4m3"):
            raise InvalidBundleError(f"kv_dtype: '{kv_dtype}', expected 'bf16' or 'e4m3'")
        self.kv_dtype = kv_dtype
        self.kv_scale = checked_kv_scale(kv_dtype, kv_scale)
        self._lib = load_library(library)
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else int(device))
        self.batch, self.draft, self.heads = int(batch), int(draft), int(heads)
        self.page_size, self.pool_pages = int(page_size), int(pool_pages)
        self.max_indices, self.max_kv_len = int(max_indices), int(max_kv_len)
        self.mask_format, self.want_lse = mask_format, bool(want_lse)
        self.mask_row_bytes = self.draft if mask_format == "bytes" else (self.draft + 7) // 8
        self.build = self._lib.verifyd_op_build().decode()
        geometry = _Geometry(self.batch, self.draft, self.heads, self.page_size, self.pool_pages,
                             self.max_indices, self.max_kv_len, int(mask_format == "bits"),
                             int(self.want_lse), float(sm_scale), int(kv_dtype == "e4m3"),
                             float(self.kv_scale))
        error = ctypes.create_string_buffer(512)
        with torch.cuda.device(self.device):
            self._op = self._lib.verifyd_op_create(ctypes.byref(geometry), error, len(error))
            if not self._op:
                raise InvalidBundleError(error.value.decode())
            self.failed = torch.zeros(1, dtype=torch.bool, device=self.device)
        # Where the device checks run: "kernel" (inside the shipped kernel) or "separate".
        self.checks = "kernel" if self._lib.verifyd_op_checks_in_kernel(self._op) else "separate"
        self._call = _Call()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if getattr(self, "_op", None):
            self._lib.verifyd_op_destroy(self._op)
            self._op = None

    def __del__(self):
        self.close()

    @property
    def device_bytes(self):
        """Device memory the op holds: its split partials and its check words."""
        return int(self._lib.verifyd_op_device_bytes(self._op))

    def _tensor(self, name, t, dtype, shape):
        """``t``'s pointer, after checking what the library takes on trust: dtype, shape,
        contiguity and device (not the values: the device checks those)."""
        if t.dtype != dtype:
            raise InvalidBundleError(f"{name}: dtype {t.dtype}, expected {dtype}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise InvalidBundleError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        if not t.is_contiguous():
            raise InvalidBundleError(f"{name}: not contiguous")
        if t.device != self.device:
            raise InvalidBundleError(f"{name}: on {t.device}, the op is on {self.device}")
        return t.data_ptr()

    def attend(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o, lse=None,
               failed=None):
        """Enqueues one call on the current stream: q bf16 [B*T, H, 576] (or [B*T, H*576]),
        kv_pool bf16 [pool_pages, page_size, 576], kv_indptr int32 [B+1], kv_indices int32
        [max_indices] (the first kv_indptr[B] read), kv_lens int32 [B] (prefix + T), tree_mask as
        opened, o bf16 [B*T, H, 512] (or 2-D) written, lse fp32 [B*T, H] with want_lse.
        ``failed``: a one-element torch.bool on the device for the verdict (a Switch's layer
        byte), else ``self.failed``. Returns the tensor the verdict goes to."""
        torch = _torch()
        c, failed = self.call_struct(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o,
                                     lse, failed)
        rc = self._lib.verifyd_op_attend(self._op, ctypes.byref(c),
                                         torch.cuda.current_stream(self.device).cuda_stream)
        if rc != 0:
            raise VerifydError(grpc.StatusCode.INTERNAL,
                               f"verifyd_op_attend: CUDA error {rc} enqueueing the call")
        return failed

    def call_struct(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o, lse=None,
                    failed=None):
        """The library's call struct for these tensors (checked as ``attend`` says), and the
        tensor its verdict goes to."""
        torch = _torch()
        rows = self.batch * self.draft
        for name, t, width in (("q", q, HEAD_DIM_QK), ("o", o, HEAD_DIM_V)):
            if t.numel() != rows * self.heads * width:
                raise InvalidBundleError(f"{name}: shape {tuple(t.shape)}, expected "
                                         f"({rows}, {self.heads}, {width})")
        c = self._call
        c.q = self._tensor("q", q.view(rows, self.heads, HEAD_DIM_QK), torch.bfloat16, None)
        pool_shape = (self.pool_pages, self.page_size, HEAD_DIM_QK)
        if self.kv_dtype == "e4m3":
            if kv_pool.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise InvalidBundleError(f"kv_pool: dtype {kv_pool.dtype}, expected "
                                         "torch.float8_e4m3fn (or uint8 codes): the op was made "
                                         "for an e4m3 pool")
            c.kv_pool = self._tensor("kv_pool", kv_pool, kv_pool.dtype, pool_shape)
        else:
            c.kv_pool = self._tensor("kv_pool", kv_pool, torch.bfloat16, pool_shape)
        c.kv_indptr = self._tensor("kv_indptr", kv_indptr, torch.int32, (self.batch + 1,))
        c.kv_indices = self._tensor("kv_indices", kv_indices, torch.int32, (self.max_indices,))
        c.kv_lens = self._tensor("kv_lens", kv_lens, torch.int32, (self.batch,))
        c.mask = self._tensor("tree_mask", tree_mask, torch.uint8,
                              (self.batch, self.draft, self.mask_row_bytes))
        c.o = self._tensor("o", o.view(rows, self.heads, HEAD_DIM_V), torch.bfloat16, None)
        if self.want_lse != (lse is not None):
            raise InvalidBundleError("lse: pass it exactly when the op was made with want_lse")
        c.lse = (self._tensor("lse", lse, torch.float32, (rows, self.heads))
                 if lse is not None else None)
        if failed is None:
            failed = self.failed
        elif failed.dtype != torch.bool or failed.numel() != 1 or failed.device != self.device:
            raise InvalidBundleError(f"failed: a one-element torch.bool on {self.device} "
                                     f"expected, got {failed.dtype} {tuple(failed.shape)} on "
                                     f"{failed.device}")
        c.failed = failed.data_ptr()
        return c, failed
