"""SGLang's FlashMLA backend in target-verify mode, on the GPU.

FlashMLABackend.forward_extend calls, for a verify step (draft chains, topk = 1):
  flash_mla_with_kvcache(q=q.view(B, T, H, 576), k_cache=k_cache.view(-1, 64, 1, 576),
                         block_table, cache_seqlens=seq_lens + T, head_dim_v=512,
                         tile_scheduler_metadata, num_splits, softmax_scale=layer.scaling,
                         causal=True)
  q              [B, T, H, 576], [B*T, H*576] or [B*T, H, 576] bf16
  k_cache        [num_pages, 64, 1, 576] bf16 (or the pool's [num_slots, 1, 576])
  block_table    int32 [B, max_pages]: each request's pages, padded with -1
  cache_seqlens  int32 [B]: prefix + T
  causal         True: draft i sees the prefix and drafts 0..i
The tile scheduler's metadata and num_splits are the kernel's own and are not read. verifyd
sees kv_pool = the pages, kv_indices = each request's first ceil(cache_seqlens / 64) pages of
block_table, kv_lens = cache_seqlens. A -1 among the pages a request reads stays -1, and
verify() refuses it.
"""

from .common import (layer_pool, HEAD_DIM_V, VerifyArgs, causal_mask, check_unsupported, fail, int_tensor,
                     kv_scale_of, o_view, pool_view, q_view, refuse, scale, segments, shape, take,
                     torch_module)

PAGE_SIZE = 64


def verify_args(q, k_cache, block_table, cache_seqlens, softmax_scale, causal=True, o=None,
                head_dim_v=HEAD_DIM_V, page_size=PAGE_SIZE, tile_scheduler_metadata=None,
                num_splits=None, k_scale=1.0, v_scale=1.0, logit_cap=0.0,
                sliding_window_size=-1, attn_sink=None, descale_q=None, descale_k=None,
                indices=None, is_fp8_kvcache=False, layer=None):
    """The VerifyArgs of one FlashMLA target-verify call, converted on q's device without a
    host synchronisation. kv_indices has B * max_pages entries (block_table's size).
    ``k_cache`` may be a pool set (client.register_cuda_set) with ``layer`` the index of the
    call's layer."""
    torch = torch_module()
    del tile_scheduler_metadata, num_splits  # the kernel's work split; no effect on the result
    window = sliding_window_size  # -1 (or 0): no window
    if window is not None and not hasattr(window, "shape") and window <= 0:
        window = None
    check_unsupported(logit_cap=logit_cap, sinks=attn_sink, sliding_window=window,
                      names={"sinks": "attn_sink", "sliding_window": "sliding_window_size"})
    for name, value in (("descale_q", descale_q), ("descale_k", descale_k)):
        if value is not None:
            refuse(name, value, "verifyd reads bf16 q and pool without scales")
    if indices is not None:
        refuse("indices", indices, "verifyd computes dense attention over the whole prefix, "
                                   "not a sparse selection (NSA)")
    if is_fp8_kvcache:
        refuse("is_fp8_kvcache", is_fp8_kvcache, "FlashMLA's fp8 cache packs per-tile scales "
                                                 "into each token's row; verifyd reads an e4m3 "
                                                 "pool with one scale")
    if head_dim_v != HEAD_DIM_V:
        fail("head_dim_v", f"{head_dim_v}, expected {HEAD_DIM_V} (MLA's latent dims)")
    s = scale(softmax_scale)
    q3 = q_view("q", q)
    device = q3.device
    int_tensor("block_table", block_table, device=device)
    if len(shape(block_table)) != 2 or shape(block_table)[0] < 1:
        fail("block_table", f"shape {list(shape(block_table))}, expected [B, max_pages]")
    batch, max_pages = shape(block_table)
    int_tensor("cache_seqlens", cache_seqlens, (batch,), device)
    tokens, heads = shape(q3)[:2]
    if tokens % batch:
        fail("q", f"{tokens} tokens are not T draft tokens for each of {batch} requests")
    draft = tokens // batch
    pool = pool_view("k_cache", layer_pool("k_cache", k_cache, layer), page_size=page_size)
    if pool.dtype != torch.bfloat16:
        fail("k_cache", f"dtype {pool.dtype}: FlashMLA's dense decode reads bf16 pages (its fp8 "
                        f"cache is is_fp8_kvcache's own layout)")
    kv_scale_of(pool, k_scale, v_scale, {"pool": "k_cache"})  # a bf16 pool: no scale

    lens = cache_seqlens.to(torch.int64)
    need = torch.div(lens + page_size - 1, page_size, rounding_mode="floor").clamp(0, max_pages)
    indptr, seg, off, used = segments(need, max(batch * max_pages, 1))
    vals = take(block_table, seg * max_pages + off).to(torch.int32)
    kv_indices = torch.where(used, vals, torch.zeros_like(vals))
    return VerifyArgs(q=q3, kv_pool=pool, kv_indptr=indptr.to(torch.int32),
                      kv_indices=kv_indices, kv_lens=lens.to(torch.int32),
                      tree_mask=causal_mask(batch, draft, device, causal), mask_format="bytes",
                      sm_scale=s, o=o_view(o, tokens, heads, device), batch=batch, draft=draft,
                      layer=layer)
