"""A verify-attention call's tensors: checked, compacted and encoded as a VerifyRequest.

Shapes (README.md, "The computation"):
  q [B*T, H, 576] bf16, kv_pool [num_pages, page_size, 576] bf16 or e4m3 (with kv_scale),
  kv_indptr [B+1] i32, kv_indices [kv_indptr[B]] i32, kv_lens [B] i32 (prefix + T),
  tree_mask u8 [B, T, T] (0/1) or [B, T, ceil(T/8)] (bit-packed), sm_scale > 0.
The checks mirror the daemon's (src/bundle/validate.cc), so a bad bundle fails here, before a
large pool is copied, with the message the daemon would give.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import tensors
from ._proto import types_pb2, verify_pb2
from .errors import InvalidBundleError

HEAD_DIM_QK = 576  # 512 latent dims (W_UK absorbed) + 64 rope dims
HEAD_DIM_V = 512
MAX_BATCH = 256
MAX_DRAFT = 1024
MAX_HEADS = 128
MAX_PAGE_SIZE = 128
MAX_PREFIX = 128 * 1024

MASK_BYTES = "bytes"
MASK_BITS = "bits"


def _shape(x):
    return tuple(int(d) for d in x.shape)


def _fail(msg):
    raise InvalidBundleError(msg)


@dataclass
class Bundle:
    """The host-side, checked form of one call: numpy arrays ready to encode."""
    q: Any                   # uint16 bf16 bits [B*T, H, 576] (check_call: as given)
    kv_pool: Any             # bits [num_pages, page_size, 576]: uint16 bf16 or uint8 e4m3
    #                          (check_call: as given)
    kv_indptr: np.ndarray    # int32 [B+1]
    kv_indices: np.ndarray   # int32 [kv_indptr[B]]
    kv_lens: np.ndarray      # int32 [B]
    tree_mask: np.ndarray    # uint8 [B, T, T] or [B, T, ceil(T/8)]
    mask_format: str         # MASK_BYTES or MASK_BITS
    sm_scale: float
    batch: int
    draft: int
    heads: int
    kv_dtype: str = tensors.KV_BF16   # or tensors.KV_E4M3
    kv_scale: float = 1.0             # an e4m3 pool's values are e4m3 x kv_scale

    def to_request(self, want_lse=False, request_id=None, device=0, compare_sync=False,
                   refs=None):
        """The VerifyRequest. ``refs`` maps field names (the six inputs, "o_out", "lse_out") to
        ready types_pb2.Tensor messages (shm or cuda_ipc refs) that replace the inline bytes.
        """
        refs = refs or {}
        req = verify_pb2.VerifyRequest(
            request_id=request_id or "",
            mask_format=(verify_pb2.MASK_FORMAT_BITS if self.mask_format == MASK_BITS
                         else verify_pb2.MASK_FORMAT_BYTES),
            sm_scale=self.sm_scale, want_lse=want_lse, device=device,
            compare_sync=compare_sync)
        if self.kv_dtype == tensors.KV_E4M3:
            req.kv_scale = self.kv_scale
        for name, dtype, a in self.inputs():
            if name in refs:
                getattr(req, name).CopyFrom(refs[name])
            else:
                _set(getattr(req, name), dtype, a)
        for name in ("o_out", "lse_out"):
            if name in refs:
                getattr(req, name).CopyFrom(refs[name])
        return req

    def inputs(self):
        """(field, DType, array) of the six input tensors, in request order."""
        return (("q", types_pb2.DTYPE_BF16, self.q),
                ("kv_pool", self.kv_pool_dtype(), self.kv_pool),
                ("kv_indptr", types_pb2.DTYPE_I32, self.kv_indptr),
                ("kv_indices", types_pb2.DTYPE_I32, self.kv_indices),
                ("kv_lens", types_pb2.DTYPE_I32, self.kv_lens),
                ("tree_mask", types_pb2.DTYPE_U8, self.tree_mask))

    def kv_pool_dtype(self):
        """The pool's DType on the wire."""
        return wire_kv_dtype(self.kv_dtype)

    def o_shape(self):
        return (self.batch * self.draft, self.heads, HEAD_DIM_V)

    def lse_shape(self):
        return (self.batch * self.draft, self.heads)


def _set(t, dtype, a):
    t.dtype = dtype
    t.shape.extend(a.shape)
    t.raw_contents = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _mask_format(name, mask_shape, draft, mask_format):
    row = mask_shape[2]
    if mask_format is None:  # for T = 1 both layouts are the same byte
        if row == draft:
            return MASK_BYTES
        if row == (draft + 7) // 8:
            return MASK_BITS
        _fail(f"{name}: shape {list(mask_shape)}: last dim must be T = {draft} (0/1 bytes) or "
              f"ceil(T/8) = {(draft + 7) // 8} (bit-packed)")
    if mask_format not in (MASK_BYTES, MASK_BITS):
        _fail(f"mask_format: '{mask_format}' is not '{MASK_BYTES}' or '{MASK_BITS}'")
    want = draft if mask_format == MASK_BYTES else (draft + 7) // 8
    if row != want:
        _fail(f"{name}: shape {list(mask_shape)} dim 2 is {row}, expected {want} "
              f"({'T' if mask_format == MASK_BYTES else 'ceil(T/8)'})")
    return mask_format


def _check_metadata(kv_indptr, kv_indices, kv_lens, mask, mask_format, batch, draft, page_size,
                    num_pages):
    """The index and mask checks of src/bundle/validate.cc, on small host arrays."""
    if kv_indptr[0] != 0:
        _fail(f"kv_indptr[0]: {kv_indptr[0]} must be 0")
    steps = np.diff(kv_indptr.astype(np.int64))
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        _fail(f"kv_indptr[{b + 1}]: {kv_indptr[b + 1]} < kv_indptr[{b}] = {kv_indptr[b]} "
              f"(must be non-decreasing)")
    if kv_indptr[batch] != kv_indices.shape[0]:
        _fail(f"kv_indptr[{batch}]: {kv_indptr[batch]} does not match the length of kv_indices "
              f"({kv_indices.shape[0]})")
    bad = (kv_indices < 0) | (kv_indices >= num_pages)
    if bad.any():
        i = int(np.argmax(bad))
        _fail(f"kv_indices[{i}]: page {kv_indices[i]} is outside the pool's [0, {num_pages})")
    for b in range(batch):
        n = int(kv_lens[b])
        if n < draft:
            _fail(f"kv_lens[{b}]: {n} is less than the draft length T = {draft} "
                  f"(kv_lens counts prefix + T)")
        if n - draft > MAX_PREFIX:
            _fail(f"kv_lens[{b}]: prefix {n - draft} exceeds the limit {MAX_PREFIX}")
        need = -(-n // page_size)
        given = int(kv_indptr[b + 1]) - int(kv_indptr[b])
        if given < need:
            _fail(f"kv_indptr: request {b} has {given} pages but kv_lens[{b}] = {n} needs {need} "
                  f"of page_size {page_size}")
    if mask_format == MASK_BYTES:
        bad = mask > 1
        if bad.any():
            b, i, j = (int(v) for v in np.argwhere(bad)[0])
            _fail(f"tree_mask[{b},{i},{j}]: {mask[b, i, j]} is not 0 or 1")
    elif draft % 8:
        pad = np.uint8((0xFF << (draft % 8)) & 0xFF)
        bad = (mask[:, :, -1] & pad) != 0
        if bad.any():
            b, i = (int(v) for v in np.argwhere(bad)[0])
            _fail(f"tree_mask[{b},{i}]: bits past T are set in the bit-packed row")


def make_bundle(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                mask_format=None, compact=True, kv_scale=None):
    """Checks one call's tensors and returns its Bundle.

    kv_pool is bf16, or e4m3 (torch.float8_e4m3fn, or numpy uint8 bits) whose values are
    e4m3 x ``kv_scale`` (SGLang's k_scale; None: 1).

    With ``compact`` only the pages the requests read (the first ceil(kv_lens[b] / page_size)
    of each request's pages) are copied out of ``kv_pool``, deduplicated, and ``kv_indices`` is
    renumbered into that compact pool; a torch pool is gathered on its own device first, so a
    GPU serving pool is never copied whole.
    """
    b = check_call(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                   mask_format=mask_format, kv_scale=kv_scale)
    compact_pool(b, kv_pool, compact)
    b.q = tensors.bf16_bits("q", q)
    return b


def compact_pool(b, kv_pool, compact):
    """Fills b.kv_pool with host bits of ``kv_pool``: the pages read (renumbering b's indices)
    with ``compact``, else the whole pool."""
    if compact:
        b.kv_pool, b.kv_indptr, b.kv_indices = _compact(kv_pool, b.kv_indptr, b.kv_indices,
                                                        b.kv_lens, _shape(kv_pool)[1])
    else:
        b.kv_pool = tensors.kv_bits("kv_pool", kv_pool)


def check_call(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
               mask_format=None, kv_scale=None):
    """The checks of make_bundle without touching q's or kv_pool's data: a Bundle whose q and
    kv_pool are the arguments as given (a transport that names them in place fills them in).
    """
    for name, x in (("q", q), ("kv_pool", kv_pool), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices), ("kv_lens", kv_lens), ("tree_mask", tree_mask)):
        if x is None or not hasattr(x, "shape"):
            _fail(f"{name}: missing (expected a numpy array or a torch tensor)")
    lens = tensors.int32_array("kv_lens", kv_lens)
    if lens.ndim != 1:
        _fail(f"kv_lens: shape {list(lens.shape)} has rank {lens.ndim}, expected 1 ([B])")
    batch = lens.shape[0]
    if not 1 <= batch <= MAX_BATCH:
        _fail(f"kv_lens: batch {batch} is outside [1, {MAX_BATCH}]")
    indptr = tensors.int32_array("kv_indptr", kv_indptr)
    if indptr.shape != (batch + 1,):
        _fail(f"kv_indptr: shape {list(indptr.shape)}, expected [{batch + 1}] (B + 1)")
    indices = tensors.int32_array("kv_indices", kv_indices)
    if indices.ndim != 1:
        _fail(f"kv_indices: shape {list(indices.shape)} has rank {indices.ndim}, expected 1")

    mask = tensors.uint8_array("tree_mask", tree_mask)
    if mask.ndim != 3:
        _fail(f"tree_mask: shape {list(mask.shape)} has rank {mask.ndim}, expected 3")
    if mask.shape[0] != batch:
        _fail(f"tree_mask: shape {list(mask.shape)} dim 0 is {mask.shape[0]}, expected {batch} "
              f"(B)")
    draft = mask.shape[1]
    if not 1 <= draft <= MAX_DRAFT:
        _fail(f"tree_mask: draft length T = {draft} is outside [1, {MAX_DRAFT}]")
    fmt = _mask_format("tree_mask", mask.shape, draft, mask_format)

    q_shape = _shape(q)
    if len(q_shape) != 3:
        _fail(f"q: shape {list(q_shape)} has rank {len(q_shape)}, expected 3 ([B*T, H, 576])")
    if q_shape[0] != batch * draft:
        _fail(f"q: shape {list(q_shape)} dim 0 is {q_shape[0]}, expected {batch * draft} (B*T)")
    if q_shape[2] != HEAD_DIM_QK:
        _fail(f"q: shape {list(q_shape)} dim 2 is {q_shape[2]}, expected 576 "
              f"(512 latent + 64 rope)")
    heads = q_shape[1]
    if not 1 <= heads <= MAX_HEADS:
        _fail(f"q: heads H = {heads} is outside [1, {MAX_HEADS}]")
    pool_shape = _shape(kv_pool)
    if len(pool_shape) != 3:
        _fail(f"kv_pool: shape {list(pool_shape)} has rank {len(pool_shape)}, expected 3 "
              f"([num_pages, page_size, 576])")
    if pool_shape[2] != HEAD_DIM_QK:
        _fail(f"kv_pool: shape {list(pool_shape)} dim 2 is {pool_shape[2]}, expected 576")
    page_size = pool_shape[1]
    if not (1 <= page_size <= MAX_PAGE_SIZE and page_size & (page_size - 1) == 0):
        _fail(f"kv_pool: page_size {page_size} is not a power of two in [1, {MAX_PAGE_SIZE}]")
    scale = _positive("sm_scale", sm_scale)
    kv_dtype = tensors.kv_dtype_of("kv_pool", kv_pool)
    kscale = checked_kv_scale(kv_dtype, kv_scale)
    _check_metadata(indptr, indices, lens, mask, fmt, batch, draft, page_size, pool_shape[0])
    return Bundle(q=q, kv_pool=kv_pool, kv_indptr=indptr, kv_indices=indices, kv_lens=lens,
                  tree_mask=mask, mask_format=fmt, sm_scale=scale, batch=batch, draft=draft,
                  heads=heads, kv_dtype=kv_dtype, kv_scale=kscale)


def checked_kv_scale(kv_dtype, kv_scale):
    """The pool's scale as a float (None: 1): finite and > 0, and 1 for a bf16 pool; else the
    daemon's error naming kv_scale."""
    if kv_scale is None:
        return 1.0
    kscale = _positive("kv_scale", kv_scale)
    if kv_dtype == tensors.KV_BF16 and kscale != 1.0:
        _fail(f"kv_scale: {kscale} is for an e4m3 pool; a bf16 kv_pool takes none (or 1)")
    return kscale


def wire_kv_dtype(kv_dtype):
    """A pool's DType on the wire, from tensors.kv_dtype_of."""
    return types_pb2.DTYPE_F8E4M3 if kv_dtype == tensors.KV_E4M3 else types_pb2.DTYPE_BF16


def _positive(name, x):
    """``x`` as a float that is finite and > 0, else the daemon's error naming ``name``."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        _fail(f"{name}: {x!r} is not a number")
    if not (math.isfinite(v) and v > 0):
        _fail(f"{name}: {v} must be finite and > 0")
    return v


def _compact(kv_pool, indptr, indices, lens, page_size):
    """Gathers the pages the requests read into a new pool and renumbers kv_indices."""
    need = -(-lens.astype(np.int64) // page_size)
    starts = indptr[:-1].astype(np.int64)
    used = np.concatenate([indices[s:s + n] for s, n in zip(starts, need)])
    pages, renumbered = np.unique(used, return_inverse=True)
    new_indptr = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    new_indptr[1:] = np.cumsum(need)
    pool = _take_pages(kv_pool, pages)
    return pool, new_indptr, renumbered.astype(np.int32)


def _take_pages(kv_pool, pages):
    if tensors.is_torch(kv_pool):
        import torch  # noqa: PLC0415 - present whenever kv_pool is a tensor

        idx = torch.as_tensor(pages, dtype=torch.long, device=kv_pool.device)
        if kv_pool.dtype == torch.float8_e4m3fn:  # index_select has no fp8 kernel: take bytes
            return tensors.kv_bits("kv_pool", kv_pool.view(torch.uint8).index_select(0, idx)
                                   .view(torch.float8_e4m3fn))
        return tensors.kv_bits("kv_pool", kv_pool.index_select(0, idx))
    pool = np.asarray(kv_pool)
    tensors.kv_dtype_of("kv_pool", pool)  # raises with the dtype
    return np.ascontiguousarray(pool.take(pages, axis=0))
