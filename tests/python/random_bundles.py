"""Seeded random verify bundles (paged pool, tree masks) and an fp64 numpy oracle of the contract (README.md, "The computation")."""

import numpy as np

from verifyd_client import from_bf16, from_e4m3, to_bf16

SM_SCALE = 1.0 / np.sqrt(192.0)
BF16_NAN = np.uint16(0x7FC0)


def tree_mask(rng, batch, draft):
    """uint8 [B, T, T]: each draft token sees itself and its ancestors in a random tree."""
    mask = np.zeros((batch, draft, draft), dtype=np.uint8)
    for b in range(batch):
        parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, draft)]
        for i in range(draft):
            j = i
            while j >= 0:
                mask[b, i, j] = 1
                j = parent[j]
    return mask


def random_bundle(rng, batch, draft, heads, page_size, prefixes, unused_pages=0,
                  spare_pages=0, share_first_page=False):
    """A dict of verify() arguments.

    Pages are scattered over a pool with ``unused_pages`` extra pages, all NaN, as are the
    slots past each request's kv_len; each request lists ``spare_pages`` extra pages past the
    ones it reads; with ``share_first_page`` every request's first page is request 0's (a
    shared prefix page).
    """
    lens = np.asarray(prefixes, dtype=np.int32) + draft
    need = -(-lens // page_size)
    num_used = int(need.sum()) + batch * spare_pages
    num_pages = num_used + unused_pages
    pool = to_bf16(rng.standard_normal((num_pages, page_size, 576), dtype=np.float32))
    perm = rng.permutation(num_pages).astype(np.int32)
    indptr = np.zeros(batch + 1, dtype=np.int32)
    indices = []
    taken = 0
    for b in range(batch):
        mine = perm[taken:taken + need[b] + spare_pages]
        taken += need[b] + spare_pages
        if share_first_page and b > 0:
            mine = mine.copy()
            mine[0] = indices[0][0]
        indices.append(mine)
        indptr[b + 1] = indptr[b] + len(mine)
    slots_read = np.zeros(num_pages, dtype=np.int64)  # per page, the slots any request reads
    for b in range(batch):
        for p, page in enumerate(indices[b][:need[b]]):
            slots = min(page_size, int(lens[b]) - p * page_size)
            slots_read[page] = max(slots_read[page], slots)
    for page in range(num_pages):
        pool[page, slots_read[page]:] = BF16_NAN
    q = to_bf16(rng.standard_normal((batch * draft, heads, 576), dtype=np.float32))
    return {"q": q, "kv_pool": pool, "kv_indptr": indptr,
            "kv_indices": np.concatenate(indices).astype(np.int32), "kv_lens": lens,
            "tree_mask": tree_mask(rng, batch, draft), "sm_scale": SM_SCALE}


def oracle(bundle):
    """fp64 o [B*T, H, 512] and lse [B*T, H] from the inputs (tree_mask as 0/1 bytes); a uint8
    kv_pool is e4m3 bits, read as e4m3 x bundle["kv_scale"] (1 when absent)."""
    q = from_bf16(bundle["q"]).astype(np.float64)
    raw = np.asarray(bundle["kv_pool"])
    if raw.dtype == np.uint8:
        pool = from_e4m3(raw, bundle.get("kv_scale") or 1.0).astype(np.float64)
    else:
        pool = from_bf16(raw).astype(np.float64)
    indptr, indices, lens = bundle["kv_indptr"], bundle["kv_indices"], bundle["kv_lens"]
    mask = bundle["tree_mask"]
    batch, draft = mask.shape[0], mask.shape[1]
    page_size = pool.shape[1]
    heads = q.shape[1]
    o = np.zeros((batch * draft, heads, 512))
    lse = np.full((batch * draft, heads), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        pages = indices[indptr[b]:indptr[b + 1]]
        k = pool[pages].reshape(-1, 576)[:n]
        prefix = n - draft
        for i in range(draft):
            visible = np.concatenate([np.ones(prefix, dtype=bool), mask[b, i].astype(bool)])
            s = q[b * draft + i] @ k[visible].T * bundle["sm_scale"]  # [H, visible]
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            z = p.sum(axis=1, keepdims=True)
            o[b * draft + i] = (p / z) @ k[visible, :512]
            lse[b * draft + i] = (m + np.log(z))[:, 0]
    return o, lse


def rel_l2(a, b):
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))
