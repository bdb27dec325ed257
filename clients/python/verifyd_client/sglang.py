"""SGLang's Triton attention backend in target-verify mode, as one verifyd call.

The adapters for SGLang's backends live in adapters/ (triton, flashinfer_mla, flashmla); these
are the Triton adapter's original entry points, kept for their callers:
  target_verify_call(...)    the converted verify() arguments, on the host (adapters.triton_host)
  sglang_target_verify(...)  one call: torch tensors are converted on their device
                             (adapters.triton.verify_args, then adapters.run); host arrays go
                             through the host conversion
The arguments are those of adapters/triton.py's module doc.
"""

import numpy as np

from . import tensors
from .adapters import run, triton, triton_host
from .adapters.common import check_unsupported, kv_scale_of


def target_verify_call(q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask,
                       mask_indptr, qo_indptr=None, skip_prefix_custom_mask=True,
                       tree_mask_mode="full"):
    """The verify() arguments (without sm_scale) of one SGLang target-verify call: a dict of
    q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, with host int32 index arrays
    (adapters.triton_host.verify_call)."""
    return triton_host.verify_call(q, k_buffer, kv_indptr, kv_indices, out_cache_loc,
                                   custom_mask, mask_indptr, qo_indptr=qo_indptr,
                                   skip_prefix_custom_mask=skip_prefix_custom_mask,
                                   tree_mask_mode=tree_mask_mode)


def sglang_target_verify(client, q, k_buffer, kv_indptr, kv_indices, out_cache_loc,
                         custom_mask, mask_indptr, sm_scale, qo_indptr=None,
                         skip_prefix_custom_mask=True, o=None, tree_mask_mode="full",
                         k_scale=1.0, v_scale=1.0, logit_cap=0.0, sliding_window_size=-1,
                         sinks=None, **verify_kwargs):
    """One verifyd call for SGLang's target-verify attention; returns client.verify's
    VerifyResult, whose o is the backend's o_extend ([B*T, H, 512]). With ``o`` (torch, the
    backend's [B*T, H*512] output) the result is written into it. ``verify_kwargs`` go to
    client.verify (want_lse, request_id, compare_sync, ...). With the cuda_ipc transport,
    register k_buffer once with client.register_kv_pool(k_buffer); it is then named in place
    on every call."""
    if tensors.is_torch(q) and tensors.is_torch(k_buffer):
        if not skip_prefix_custom_mask and triton.tree_mask_mode_of(tree_mask_mode) == "full":
            # read on the host: this path synchronises anyway
            _check_prefix_columns(q, kv_indptr, custom_mask, mask_indptr)
        args = triton.verify_args(q, k_buffer, kv_indptr, kv_indices, out_cache_loc,
                                  custom_mask, mask_indptr, sm_scale, qo_indptr=qo_indptr, o=o,
                                  tree_mask_mode=tree_mask_mode, k_scale=k_scale,
                                  v_scale=v_scale, logit_cap=logit_cap,
                                  sliding_window_size=sliding_window_size, sinks=sinks)
        return run(client, args, **verify_kwargs)
    window = sliding_window_size if sliding_window_size is not None and \
        sliding_window_size > 0 else None
    check_unsupported(logit_cap=logit_cap, sinks=sinks, sliding_window=window,
                      names={"sliding_window": "sliding_window_size"})
    kv_scale = kv_scale_of(k_buffer, k_scale, v_scale)
    if o is not None:
        raise ValueError("o: writing into the caller's output needs torch tensors")
    call = target_verify_call(q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask,
                              mask_indptr, qo_indptr=qo_indptr,
                              skip_prefix_custom_mask=skip_prefix_custom_mask,
                              tree_mask_mode=tree_mask_mode)
    return client.verify(**call, sm_scale=sm_scale, kv_scale=kv_scale, **verify_kwargs)


def _check_prefix_columns(q, kv_indptr, custom_mask, mask_indptr):
    indptr = triton_host._host("kv_indptr", kv_indptr)
    prefix = np.diff(indptr)
    draft = int(q.shape[0]) // (indptr.shape[0] - 1)
    lens = prefix + draft
    if mask_indptr is None:
        mptr = np.concatenate([[0], np.cumsum(draft * lens)])
    else:
        mptr = triton_host._host("mask_indptr", mask_indptr)
    triton_host.check_prefix_columns(custom_mask, mptr, prefix, lens, draft)
