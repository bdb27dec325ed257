"""The Triton adapter on host arrays (numpy, or torch read to the host): every index checked,
exact-length int32 arrays. For callers without torch on the GPU, and for the prefix-column
check that the GPU path cannot make without a synchronisation. The arguments are those of
triton.py (the module doc there)."""

import numpy as np

from .. import tensors
from ..bundle import HEAD_DIM_QK
from ..errors import InvalidBundleError
from .triton import tree_mask_mode_of


def _host(name, x):
    a = x.detach().cpu().numpy() if tensors.is_torch(x) else np.asarray(x)
    if a.dtype.kind not in "iu":
        raise InvalidBundleError(f"{name}: dtype {a.dtype}, expected an integer type")
    return a.astype(np.int64, copy=False)


def _fail(msg):
    raise InvalidBundleError(msg)


def verify_call(q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask, mask_indptr,
                qo_indptr=None, skip_prefix_custom_mask=True, tree_mask_mode="full"):
    """The verify() arguments (without sm_scale) of one Triton target-verify call: a dict of
    q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask. kv_pool is a view of k_buffer and
    tree_mask is gathered on custom_mask's device; the index arrays are host int32.

    With ``skip_prefix_custom_mask`` False (the backend reads the prefix columns of the mask),
    every prefix column must be set: verifyd's calls always see the whole prefix.
    """
    mode = tree_mask_mode_of(tree_mask_mode)
    indptr = _host("kv_indptr", kv_indptr)
    if indptr.ndim != 1 or indptr.shape[0] < 2:
        _fail(f"kv_indptr: shape {list(indptr.shape)}, expected [B+1] with B >= 1")
    batch = indptr.shape[0] - 1
    prefix = np.diff(indptr)
    if indptr[0] != 0 or (prefix < 0).any():
        _fail("kv_indptr: must start at 0 and be non-decreasing")
    tokens = int(q.shape[0])
    if tokens % batch:
        _fail(f"q: {tokens} tokens are not T draft tokens for each of {batch} requests")
    draft = tokens // batch
    if qo_indptr is not None:
        want = np.arange(0, (batch + 1) * draft, draft)
        got = _host("qo_indptr", qo_indptr)
        if got.shape != want.shape or (got != want).any():
            _fail(f"qo_indptr: {got.tolist()} is not {draft} draft tokens per request")
    indices = _host("kv_indices", kv_indices)
    if indices.shape[0] < indptr[-1]:
        _fail(f"kv_indices: {indices.shape[0]} entries, kv_indptr[{batch}] needs {indptr[-1]}")
    loc = _host("out_cache_loc", out_cache_loc).reshape(-1)
    if loc.shape[0] != tokens:
        _fail(f"out_cache_loc: {loc.shape[0]} slots, expected B*T = {tokens}")
    lens = prefix + draft
    if mode == "full":
        mask = _full_mask(custom_mask, mask_indptr, prefix, lens, batch, draft,
                          skip_prefix_custom_mask)
    else:
        mask = _qlen_mask(custom_mask, mode, batch, draft)

    new_indptr = np.zeros(batch + 1, dtype=np.int64)
    new_indptr[1:] = np.cumsum(lens)
    new_indices = np.concatenate([
        np.concatenate([indices[indptr[b]:indptr[b + 1]], loc[b * draft:(b + 1) * draft]])
        for b in range(batch)])
    if len(k_buffer.shape) == 2:
        pool = k_buffer.reshape(k_buffer.shape[0], 1, k_buffer.shape[1])
    elif len(k_buffer.shape) == 3 and int(k_buffer.shape[1]) == 1:
        pool = k_buffer
    else:
        _fail(f"k_buffer: shape {list(k_buffer.shape)}, expected [num_slots, 1, "
              f"{HEAD_DIM_QK}] or [num_slots, {HEAD_DIM_QK}] (page size 1)")
    return {"q": q, "kv_pool": pool, "kv_indptr": tensors.int32_array("kv_indptr", new_indptr),
            "kv_indices": tensors.int32_array("kv_indices", new_indices),
            "kv_lens": tensors.int32_array("kv_lens", lens), "tree_mask": mask}


def _full_mask(custom_mask, mask_indptr, prefix, lens, batch, draft, skip_prefix):
    if mask_indptr is None:
        mptr = np.zeros(batch + 1, dtype=np.int64)
        mptr[1:] = np.cumsum(draft * lens)
    else:
        mptr = _host("mask_indptr", mask_indptr)
    if mptr.shape != (batch + 1,):
        _fail(f"mask_indptr: shape {list(mptr.shape)}, expected [{batch + 1}] (B + 1)")
    sizes = np.diff(mptr)
    for b in range(batch):
        if sizes[b] != draft * lens[b]:
            _fail(f"mask_indptr[{b + 1}]: request {b} has {sizes[b]} mask entries, expected "
                  f"T * (prefix + T) = {draft} * {lens[b]}")
    if int(custom_mask.shape[0]) < mptr[-1]:
        _fail(f"custom_mask: {int(custom_mask.shape[0])} entries, mask_indptr[{batch}] needs "
              f"{mptr[-1]}")
    i = np.arange(draft)[:, None]
    j = np.arange(draft)[None, :]
    gather = np.stack([mptr[b] + i * lens[b] + prefix[b] + j for b in range(batch)])
    mask = _take(custom_mask, gather)
    if not skip_prefix:
        check_prefix_columns(custom_mask, mptr, prefix, lens, draft)
    return mask


def check_prefix_columns(custom_mask, mptr, prefix, lens, draft):
    """Refuses a flat mask that hides part of a request's prefix (host arrays mptr, prefix,
    lens): verifyd's calls always see the whole prefix."""
    i = np.arange(draft)[:, None]
    for b in range(len(prefix)):
        cols = (mptr[b] + i * lens[b] + np.arange(prefix[b])[None, :]).reshape(-1)
        if cols.size and not bool(_take(custom_mask, cols).all()):
            _fail(f"custom_mask: request {b} masks part of its prefix; verifyd's calls "
                  f"always see the whole prefix")


def _qlen_mask(custom_mask, mode, batch, draft):
    a = custom_mask.detach().cpu().numpy() if tensors.is_torch(custom_mask) else \
        np.asarray(custom_mask)
    flat = a.reshape(-1)
    if mode == "qlen":
        if flat.shape[0] < batch * draft * draft:
            _fail(f"custom_mask: {flat.shape[0]} entries, expected B*T*T = "
                  f"{batch * draft * draft}")
        return (flat[:batch * draft * draft].reshape(batch, draft, draft) != 0).astype(np.uint8)
    width = a.dtype.itemsize
    if a.dtype.kind not in "iu" or width * 8 < draft:
        _fail(f"custom_mask: dtype {a.dtype}: a bit-packed row of T = {draft} needs an integer "
              f"type of at least {draft} bits")
    if flat.shape[0] < batch * draft:
        _fail(f"custom_mask: {flat.shape[0]} packed rows, expected B*T = {batch * draft}")
    rows = np.ascontiguousarray(flat[:batch * draft]).astype(a.dtype.newbyteorder("<"))
    bits = rows.view(np.uint8).reshape(batch, draft, width)[:, :, :(draft + 7) // 8].copy()
    if draft % 8:
        bits[:, :, -1] &= (1 << (draft % 8)) - 1
    return bits


def _take(mask, idx):
    """mask[idx] as uint8 0/1, gathered where mask lives."""
    if tensors.is_torch(mask):
        import torch  # noqa: PLC0415 - present whenever mask is a tensor

        at = torch.from_numpy(np.ascontiguousarray(idx)).to(mask.device)
        return mask.reshape(-1)[at].to(torch.uint8)
    return np.asarray(mask).reshape(-1)[idx].astype(np.uint8)
