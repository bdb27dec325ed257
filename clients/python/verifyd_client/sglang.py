"""SGLang's Triton attention backend in target-verify mode, as one verifyd call.

What the backend hands extend_attention_fwd when it verifies a draft tree (page size 1):
  q              [B*T, H, 576] bf16  the draft tokens' queries (MLA: 512 latent + 64 rope)
  k_buffer       [num_slots, 1, 576] or [num_slots, 576] bf16: the layer's token-slot pool
                 (token_to_kv_pool.get_key_buffer); v is its first 512 dims
  kv_indptr      [B+1], kv_indices: the pool slots of each request's prefix (seq_lens, without
                 the draft tokens)
  out_cache_loc  [B*T]: the slots the draft tokens' k/v were written to before attention
  custom_mask    flat bool: per request b, a row-major [T, prefix_b + T] block starting at
                 mask_indptr[b]; row i is draft token i, columns the prefix then the draft tokens
  mask_indptr    [B+1]
  qo_indptr      [B+1] (optional): arange(0, (B+1)*T, T)
verifyd sees the same call as kv_pool = the slot pool with page_size 1, kv_indices = prefix slots
then draft slots, kv_lens = prefix + T and tree_mask = the draft-to-draft block of custom_mask.
"""

import numpy as np

from . import tensors
from .bundle import HEAD_DIM_QK
from .errors import InvalidBundleError


def _host(name, x):
    a = x.detach().cpu().numpy() if tensors.is_torch(x) else np.asarray(x)
    if a.dtype.kind not in "iu":
        raise InvalidBundleError(f"{name}: dtype {a.dtype}, expected an integer type")
    return a.astype(np.int64, copy=False)


def _fail(msg):
    raise InvalidBundleError(msg)


def target_verify_call(q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask,
                       mask_indptr, qo_indptr=None, skip_prefix_custom_mask=True):
    """The verify() arguments (without sm_scale) of one SGLang target-verify call: a dict of
    q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask. kv_pool is a view of k_buffer and
    tree_mask is gathered on custom_mask's device; the index arrays are host int32.

    With ``skip_prefix_custom_mask`` False (the backend reads the prefix columns of the mask),
    every prefix column must be set: verifyd's calls always see the whole prefix.
    """
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

    new_indptr = np.zeros(batch + 1, dtype=np.int64)
    new_indptr[1:] = np.cumsum(lens)
    new_indices = np.concatenate([
        np.concatenate([indices[indptr[b]:indptr[b + 1]], loc[b * draft:(b + 1) * draft]])
        for b in range(batch)])
    i = np.arange(draft)[:, None]
    j = np.arange(draft)[None, :]
    gather = np.stack([mptr[b] + i * lens[b] + prefix[b] + j for b in range(batch)])
    mask = _take(custom_mask, gather)
    if not skip_prefix_custom_mask:
        for b in range(batch):
            cols = (mptr[b] + i * lens[b] + np.arange(prefix[b])[None, :]).reshape(-1)
            if cols.size and not bool(_take(custom_mask, cols).all()):
                _fail(f"custom_mask: request {b} masks part of its prefix; verifyd's calls "
                      f"always see the whole prefix")
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


def _take(mask, idx):
    """mask[idx] as uint8 0/1, gathered where mask lives."""
    if tensors.is_torch(mask):
        import torch  # noqa: PLC0415 - present whenever mask is a tensor

        at = torch.from_numpy(np.ascontiguousarray(idx)).to(mask.device)
        return mask.reshape(-1)[at].to(torch.uint8)
    return np.asarray(mask).reshape(-1)[idx].astype(np.uint8)


def sglang_target_verify(client, q, k_buffer, kv_indptr, kv_indices, out_cache_loc,
                         custom_mask, mask_indptr, sm_scale, qo_indptr=None,
                         skip_prefix_custom_mask=True, **verify_kwargs):
    """One verifyd call for SGLang's target-verify attention (see the module doc for the
    arguments); returns client.verify's VerifyResult, whose o is the backend's o_extend
    ([B*T, H, 512], v_head_dim 512). ``verify_kwargs`` go to client.verify (want_lse,
    request_id, compare_sync, ...). With the cuda_ipc transport, register k_buffer once with
    client.register_kv_pool(k_buffer); it is then named in place on every call."""
    call = target_verify_call(q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask,
                              mask_indptr, qo_indptr=qo_indptr,
                              skip_prefix_custom_mask=skip_prefix_custom_mask)
    return client.verify(**call, sm_scale=sm_scale, **verify_kwargs)
