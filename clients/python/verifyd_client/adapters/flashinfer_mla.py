"""SGLang's FlashInfer MLA backend in target-verify mode, on the GPU.

FlashInferMLAAttnBackend plans BatchMLAPagedAttentionWrapper for a verify step with
spec_info.generate_attn_arg_prefill (draft trees of topk = 1, i.e. chains) and runs it:
  plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, 512, 64, page_size=1,
       causal=True, sm_scale=model_config.scaling, ...)
  run(q_nope, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:], out=o)
  q_nope         [tokens, H*512] or [tokens, H, 512] bf16 (forward_extend's q when it is given
                 q_rope); or q [tokens, H*576] with q_rope None
  q_rope         [tokens, H*64] or [tokens, H, 64] bf16
  k_buffer       [num_slots, 1, 576] bf16 (get_key_buffer), or float8_e4m3fn with k_scale (a
                 host float; v_scale equal to it)
  kv_indptr      int32 [B+1] over prefix + T tokens per request
  kv_indices     int32: each request's prefix slots then its draft slots (req_to_token), in a
                 buffer that may be longer than kv_indptr[B] (the CUDA-graph buffer)
  kv_len_arr     int32 [B] (default kv_indptr's differences); qo_indptr [B+1]: B*T tokens
  causal         True: draft i sees the prefix and drafts 0..i (the kernel's causal mask,
                 aligned to the end of each sequence)
verifyd sees kv_pool = k_buffer with page size 1 and the same kv_indptr / kv_indices.
"""

from .common import (layer_pool, HEAD_DIM_ROPE, HEAD_DIM_V, VerifyArgs, causal_mask,
                     check_unsupported, fail, int_tensor, kv_scale_of, o_view, pool_view, q_view,
                     scale, shape, torch_module)


def verify_args(q, k_buffer, kv_indptr, kv_indices, sm_scale, q_rope=None, qo_indptr=None,
                kv_len_arr=None, page_size=1, causal=True, o=None, kv_bound=None, k_scale=1.0,
                v_scale=1.0, logit_cap=0.0, window_left=-1, sinks=None, layer=None):
    """The VerifyArgs of one FlashInfer MLA target-verify call, converted on q's device without
    a host synchronisation. ``kv_bound`` (a host int >= kv_indptr[B]) cuts a long kv_indices
    buffer to a view of its first kv_bound entries. ``k_buffer`` may be a pool set
    (client.register_cuda_set) with ``layer`` the index of the call's layer."""
    torch = torch_module()
    window = window_left  # -1: no window
    if window is not None and not hasattr(window, "shape") and window < 0:
        window = None
    check_unsupported(logit_cap=logit_cap, sinks=sinks, sliding_window=window,
                      names={"sliding_window": "window_left"})
    s = scale(sm_scale)
    if q_rope is None:
        q3 = q_view("q", q)
    else:
        nope = q_view("q", q, dim=HEAD_DIM_V)
        rope = q_view("q_rope", q_rope, tokens=shape(nope)[0], dim=HEAD_DIM_ROPE)
        if shape(rope)[1] != shape(nope)[1]:
            fail("q_rope", f"{shape(rope)[1]} heads, q has {shape(nope)[1]}")
        q3 = torch.cat([nope, rope], dim=-1)
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
    indices = kv_indices if kv_bound is None else kv_indices[:int(kv_bound)]
    if kv_len_arr is not None:
        lens = int_tensor("kv_len_arr", kv_len_arr, (batch,), device)
    elif page_size == 1:
        lens = kv_indptr[1:] - kv_indptr[:-1]
    else:
        fail("kv_len_arr", f"needed with page_size {page_size} (kv_indptr counts pages)")
    pool = pool_view("k_buffer", layer_pool("k_buffer", k_buffer, layer), page_size=page_size)
    kv_scale = kv_scale_of(pool, k_scale, v_scale)
    return VerifyArgs(q=q3, kv_pool=pool, kv_indptr=kv_indptr.to(torch.int32),
                      kv_indices=indices.to(torch.int32), kv_lens=lens.to(torch.int32),
                      tree_mask=causal_mask(batch, draft, device, causal), mask_format="bytes",
                      sm_scale=s, o=o_view(o, tokens, heads, device), batch=batch, draft=draft,
                      layer=layer, kv_scale=kv_scale)
