"""SGLang's Triton attention backend in target-verify mode (MLA, page size 1), on the GPU.

TritonAttnBackend.forward_extend hands extend_attention_fwd, for a verify step:
  q              [B*T, H*576] or [B*T, H, 576] bf16: the draft tokens' queries
  k_buffer       [num_slots, 1, 576] (token_to_kv_pool.get_key_buffer), bf16 or
                 float8_e4m3fn; v_buffer is a view of its first 512 dims
  kv_indptr      [B+1], kv_indices: each request's prefix slots (seq_lens, without the drafts);
                 under a CUDA graph kv_indices is the whole graph buffer
  out_cache_loc  [B*T]: the slots the drafts' k/v were written to before attention. The kernel
                 reads the drafts' K from k_extend; for a bf16 pool that is the same data, so
                 verifyd reads it from the pool at out_cache_loc (for an fp8 pool k_extend holds
                 the drafts before their quantisation, and verifyd reads them as stored)
  custom_mask    the draft tree's mask (spec_info.custom_mask, or the uint8 CUDA-graph buffer),
                 in one of SGLang's TreeMaskMode layouts (``tree_mask_mode``):
                   "full" (FULL_MASK, 0): flat bool/uint8; request b's row-major
                       [T, prefix_b + T] block starts at mask_indptr[b]
                   "qlen" (QLEN_ONLY, 1): bool/uint8 [B, T, T] (any shape of B*T*T items)
                   "qlen_packed" (QLEN_ONLY_BITPACKING, 2): one uint8/int16/int32 item per
                       draft row ([B*T]); bit j of the item (byte j/8, bit j%8) is column j
                 None: the drafts are a chain (causal)
  mask_indptr    [B+1] ("full" only; None: computed from kv_indptr)
  sm_scale       layer.scaling
  k_scale        an fp8 pool's scale, a host float (layer.k_scale_float); v_scale must equal
                 it; a bf16 pool takes neither (or 1)
  logit_cap, sliding_window_size, sinks, xai_temperature_len: refused unless they leave the
                 result unchanged
verifyd sees kv_pool = k_buffer with page size 1, kv_indices = each request's prefix slots then
its draft slots, kv_lens = prefix + T, tree_mask = the draft-to-draft block of the mask.
"""

from .common import (layer_pool, VerifyArgs, causal_mask, check_unsupported, fail, int_tensor,
                     kv_scale_of, o_view,
                     pool_view, q_view, refuse, scale, segments, shape, take, torch_module)

MODES = {"full": 0, "qlen": 1, "qlen_packed": 2}


def tree_mask_mode_of(mode):
    """"full" / "qlen" / "qlen_packed", from the name or SGLang's TreeMaskMode (0, 1, 2)."""
    if isinstance(mode, str) and mode in MODES:
        return mode
    try:
        value = int(mode)
    except (TypeError, ValueError):
        value = None
    for name, v in MODES.items():
        if value == v:
            return name
    fail("tree_mask_mode", f"{mode!r} is not one of {', '.join(MODES)} (or 0, 1, 2)")


def verify_args(q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask, mask_indptr,
                sm_scale, qo_indptr=None, o=None, tree_mask_mode="full",
                skip_prefix_custom_mask=True, v_buffer=None, k_scale=1.0, v_scale=1.0,
                logit_cap=0.0, sliding_window_size=-1, sinks=None, xai_temperature_len=-1,
                kv_bound=None, layer=None):
    """The VerifyArgs of one Triton target-verify call, converted on q's device without a host
    synchronisation (see the module doc for the arguments). ``k_buffer`` may be a pool set
    (client.register_cuda_set) with ``layer`` the index of the call's layer.

    kv_indices of the result has kv_indices.numel() + B*T entries, or kv_bound + B*T with
    ``kv_bound`` (a host int >= kv_indptr[B], e.g. B * the context length, for a CUDA-graph
    kv_indices buffer far larger than a step needs).
    """
    torch = torch_module()
    window = sliding_window_size  # -1 (or 0): no window
    if window is not None and not hasattr(window, "shape") and window <= 0:
        window = None
    check_unsupported(logit_cap=logit_cap, sinks=sinks, sliding_window=window,
                      names={"sliding_window": "sliding_window_size"})
    if xai_temperature_len is not None and xai_temperature_len > 0:
        refuse("xai_temperature_len", xai_temperature_len,
               "verifyd does not scale queries by position")
    mode = tree_mask_mode_of(tree_mask_mode)
    if not skip_prefix_custom_mask and mode == "full":
        refuse("skip_prefix_custom_mask", skip_prefix_custom_mask,
               "verifyd's calls always see the whole prefix, and the mask's prefix columns "
               "cannot be checked without reading them on the host (sglang_target_verify "
               "checks them on its eager path)")
    s = scale(sm_scale)
    q3 = q_view("q", q)
    device = q3.device
    int_tensor("kv_indptr", kv_indptr, device=device)
    if len(shape(kv_indptr)) != 1 or shape(kv_indptr)[0] < 2:
        fail("kv_indptr", f"shape {list(shape(kv_indptr))}, expected [B+1] with B >= 1")
    batch = shape(kv_indptr)[0] - 1
    tokens, heads = shape(q3)[:2]
    if tokens % batch:
        fail("q", f"{tokens} tokens are not T draft tokens for each of {batch} requests")
    draft = tokens // batch
    if qo_indptr is not None:
        int_tensor("qo_indptr", qo_indptr, (batch + 1,), device)
    int_tensor("kv_indices", kv_indices, device=device)
    if len(shape(kv_indices)) != 1:
        fail("kv_indices", f"shape {list(shape(kv_indices))}, expected 1-D")
    int_tensor("out_cache_loc", out_cache_loc, device=device)
    loc = out_cache_loc.reshape(-1)
    if shape(loc)[0] != tokens:
        fail("out_cache_loc", f"{shape(loc)[0]} slots, expected B*T = {tokens}")
    k_buffer = layer_pool("k_buffer", k_buffer, layer)
    try:
        pool = pool_view("k_buffer", k_buffer, page_size=1)
    except ValueError as e:
        fail("k_buffer", f"{str(e).split(': ', 1)[1]} (page size 1)")
    kv_scale = kv_scale_of(pool, k_scale, v_scale)
    if v_buffer is not None and v_buffer.data_ptr() != k_buffer.data_ptr():
        refuse("v_buffer", v_buffer, "verifyd reads V as the first 512 dims of the pool "
                                     "(k_buffer); a separate V buffer is not MLA's layout")

    prefix = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    n_prefix = shape(kv_indices)[0] if kv_bound is None else min(shape(kv_indices)[0],
                                                                 int(kv_bound))
    drafts = torch.full((batch,), draft, dtype=torch.int64, device=device)
    # Two segments per request, prefix then drafts: segment 2b from kv_indices, 2b+1 from
    # out_cache_loc.
    lens = torch.stack([prefix, drafts], 1).reshape(-1)
    indptr, seg, off, used = segments(lens, n_prefix + tokens)
    req = seg // 2
    from_prefix = take(kv_indices, kv_indptr.to(torch.int64)[req] + off)
    from_draft = take(loc, req * draft + off)
    vals = torch.where(seg % 2 == 0, from_prefix.to(torch.int32), from_draft.to(torch.int32))
    new_indices = torch.where(used, vals, torch.zeros_like(vals))
    new_indptr = indptr[::2].to(torch.int32).contiguous()
    kv_lens = (prefix + draft).to(torch.int32)

    tree, fmt = _tree_mask(custom_mask, mask_indptr, mode, prefix, batch, draft, device)
    return VerifyArgs(q=q3, kv_pool=pool, kv_indptr=new_indptr, kv_indices=new_indices,
                      kv_lens=kv_lens, tree_mask=tree, mask_format=fmt, sm_scale=s,
                      o=o_view(o, tokens, heads, device), batch=batch, draft=draft,
                      layer=layer, kv_scale=kv_scale)


def _tree_mask(custom_mask, mask_indptr, mode, prefix, batch, draft, device):
    """(tree_mask, mask_format) from the backend's custom_mask, on the device."""
    torch = torch_module()
    if custom_mask is None:
        return causal_mask(batch, draft, device), "bytes"
    if not isinstance(custom_mask, torch.Tensor) or custom_mask.device != device:
        fail("custom_mask", f"expected a torch tensor on {device} (q's device)")
    items = custom_mask.numel()
    if mode == "qlen_packed":
        width = custom_mask.element_size()
        if custom_mask.dtype.is_floating_point or custom_mask.dtype == torch.bool or \
                width * 8 < draft:
            fail("custom_mask", f"dtype {custom_mask.dtype}: a bit-packed row of T = {draft} "
                                f"needs an integer type of at least {draft} bits")
        if items < batch * draft:
            fail("custom_mask", f"{items} packed rows, expected B*T = {batch * draft}")
        rows = custom_mask.reshape(-1)[:batch * draft].contiguous()
        nbytes = (draft + 7) // 8
        bits = rows.view(torch.uint8).reshape(batch, draft, width)[:, :, :nbytes].clone()
        if draft % 8:  # only columns < T: the bits past T are not the call's
            bits[:, :, -1] &= (1 << (draft % 8)) - 1
        return bits, "bits"
    if custom_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
        fail("custom_mask", f"dtype {custom_mask.dtype}, expected bool or uint8")
    if mode == "qlen":
        if items < batch * draft * draft:
            fail("custom_mask", f"{items} entries, expected B*T*T = {batch * draft * draft}")
        block = custom_mask.reshape(-1)[:batch * draft * draft].reshape(batch, draft, draft)
        return (block != 0).to(torch.uint8), "bytes"
    if mask_indptr is None:
        mptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
        mptr[1:] = torch.cumsum(draft * (prefix + draft), 0)
    else:
        mptr = int_tensor("mask_indptr", mask_indptr, (batch + 1,), device).to(torch.int64)
    i = torch.arange(draft, dtype=torch.int64, device=device)
    row = (prefix + draft)[:, None, None]
    at = mptr[:-1, None, None] + i[None, :, None] * row + prefix[:, None, None] + i[None, None, :]
    return (take(custom_mask, at) != 0).to(torch.uint8), "bytes"
