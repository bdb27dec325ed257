"""SGLang target-verify calls: seeded random inputs in the Triton backend's layout, and an
independent fp64 implementation of what its extend attention computes for them (numpy, and
torch for the GPU test).

The layout (page size 1): a token-slot pool k_buffer [num_slots, 1, 576]; per request b the
prefix slots kv_indices[kv_indptr[b]:kv_indptr[b+1]], the draft tokens' slots
out_cache_loc[b*T:(b+1)*T], and a flat bool custom_mask holding a row-major [T, prefix_b + T]
block at mask_indptr[b]. Query token i of request b attends to key j of its
prefix + draft sequence where the block's [i, j] is set; v is k's first 512 dims.
"""

import numpy as np

from random_bundles import tree_mask
from verifyd_client import from_bf16, to_bf16


def random_target_verify(rng, batch, draft, heads, prefixes, spare_slots=37):
    """A dict of the backend's arguments (numpy; bf16 as uint16 bits, indices int64)."""
    prefixes = np.asarray(prefixes, dtype=np.int64)
    num_slots = int(prefixes.sum()) + batch * draft + spare_slots
    k_buffer = to_bf16(rng.standard_normal((num_slots, 1, 576), dtype=np.float32))
    perm = rng.permutation(num_slots).astype(np.int64)
    kv_indptr = np.zeros(batch + 1, dtype=np.int64)
    kv_indptr[1:] = np.cumsum(prefixes)
    kv_indices = perm[:kv_indptr[-1]]
    out_cache_loc = perm[kv_indptr[-1]:kv_indptr[-1] + batch * draft]
    tree = tree_mask(rng, batch, draft).astype(bool)
    blocks = []
    for b in range(batch):
        block = np.ones((draft, int(prefixes[b]) + draft), dtype=bool)
        block[:, int(prefixes[b]):] = tree[b]
        blocks.append(block.reshape(-1))
    mask_indptr = np.zeros(batch + 1, dtype=np.int64)
    mask_indptr[1:] = np.cumsum([blk.size for blk in blocks])
    q = to_bf16(rng.standard_normal((batch * draft, heads, 576), dtype=np.float32))
    return {"q": q, "k_buffer": k_buffer, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
            "out_cache_loc": out_cache_loc, "custom_mask": np.concatenate(blocks),
            "mask_indptr": mask_indptr,
            "qo_indptr": np.arange(0, (batch + 1) * draft, draft, dtype=np.int64)}


def extend_attention_numpy(call, sm_scale):
    """fp64 o [B*T, H, 512] and lse [B*T, H] of the call, read the way the backend reads it
    (k_buffer: bf16 bits, or the pool's values as floats)."""
    q = from_bf16(call["q"]).astype(np.float64)
    k = call["k_buffer"]
    k_all = (k if np.issubdtype(k.dtype, np.floating) else from_bf16(k)).astype(
        np.float64).reshape(-1, 576)
    indptr, mptr = call["kv_indptr"], call["mask_indptr"]
    batch = len(indptr) - 1
    draft = q.shape[0] // batch
    o = np.zeros((q.shape[0], q.shape[1], 512))
    lse = np.zeros(q.shape[:2])
    for b in range(batch):
        slots = np.concatenate([call["kv_indices"][indptr[b]:indptr[b + 1]],
                                call["out_cache_loc"][b * draft:(b + 1) * draft]])
        k = k_all[slots]
        n = len(slots)
        mask = call["custom_mask"][mptr[b]:mptr[b + 1]].reshape(draft, n)
        for i in range(draft):
            s = q[b * draft + i] @ k[mask[i]].T * sm_scale
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            z = p.sum(axis=1, keepdims=True)
            o[b * draft + i] = (p / z) @ k[mask[i], :512]
            lse[b * draft + i] = (m + np.log(z))[:, 0]
    return o, lse


def extend_attention_torch(q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask,
                           mask_indptr, sm_scale):
    """The same in torch fp64 on the tensors' device: o [B*T, H, 512], lse [B*T, H]."""
    import torch

    qd = q.double()
    k_all = k_buffer.reshape(-1, 576).double()
    indptr, mptr = kv_indptr.tolist(), mask_indptr.tolist()
    batch = len(indptr) - 1
    draft = q.shape[0] // batch
    o = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64, device=q.device)
    lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float64, device=q.device)
    for b in range(batch):
        slots = torch.cat([kv_indices[indptr[b]:indptr[b + 1]],
                           out_cache_loc[b * draft:(b + 1) * draft]]).long()
        k = k_all[slots]
        mask = custom_mask[mptr[b]:mptr[b + 1]].reshape(draft, len(slots))
        s = torch.einsum("thd,nd->thn", qd[b * draft:(b + 1) * draft], k) * sm_scale
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        lse[b * draft:(b + 1) * draft] = torch.logsumexp(s, dim=-1)
        o[b * draft:(b + 1) * draft] = torch.einsum("thn,nd->thd", torch.softmax(s, dim=-1),
                                                    k[:, :512])
    return o, lse
