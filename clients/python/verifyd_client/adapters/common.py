"""What every backend adapter shares: VerifyArgs, the eager call, and the GPU-side helpers.

An adapter's ``verify_args(...)`` turns one backend's target-verify arguments into a VerifyArgs
with torch ops only, on the arguments' device: no .cpu(), .item(), .tolist(), numpy, nor an
output whose shape depends on tensor values, so that the conversion can be captured in a CUDA
graph. Where an output's length depends on the data (the concatenated kv_indices), it is a
buffer of a host-known bound; kv_indptr[B] says how much of it is used. Arguments whose values
verifyd cannot see without a synchronisation (indices in range, a consistent mask_indptr) are
trusted here, as the backend's kernel trusts them; client.verify and the daemon check them.
"""

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from .. import tensors
from ..bundle import HEAD_DIM_QK, HEAD_DIM_V, MASK_BITS, MASK_BYTES
from ..regions import PoolSet

HEAD_DIM_ROPE = HEAD_DIM_QK - HEAD_DIM_V  # 64


@dataclass
class VerifyArgs:
    """One verify call's arguments, on the caller's device (README.md, "The computation")."""
    q: Any                # bf16 [B*T, H, 576], a view of the caller's q when possible
    kv_pool: Any          # [num_pages, page_size, 576] bf16 or float8_e4m3fn, a view of the
                          # backend's pool
    kv_indptr: Any        # int32 [B+1]
    kv_indices: Any       # int32 [N], N a host-known bound >= kv_indptr[B]; the tail is unused
    kv_lens: Any          # int32 [B]: prefix + T
    tree_mask: Any        # uint8 [B, T, T] (bytes) or [B, T, ceil(T/8)] (bits)
    mask_format: str      # "bytes" or "bits"
    sm_scale: float
    o: Optional[Any]      # the caller's output as a bf16 [B*T, H, 512] view, or None
    batch: int
    draft: int
    layer: Optional[int] = None  # the member of a pool set kv_pool is, or None
    kv_scale: Optional[float] = None  # an fp8 pool's scale (the backend's k_scale); None: bf16


def run(client, args, **verify_kwargs):
    """The eager path: client.verify(...) on ``args``; returns its VerifyResult.

    kv_indices is cut to kv_indptr[B] here (one read of that value from the device; the call
    synchronises anyway). With ``args.o`` the output is copied into the caller's tensor and the
    result's o is that view. ``verify_kwargs`` go to client.verify (want_lse, request_id,
    compare_sync, device, compact)."""
    used = int(args.kv_indptr[args.batch])
    r = client.verify(args.q, args.kv_pool, args.kv_indptr, args.kv_indices[:used], args.kv_lens,
                      args.tree_mask, args.sm_scale, mask_format=args.mask_format,
                      kv_scale=args.kv_scale, **verify_kwargs)
    if args.o is None:
        return r
    args.o.copy_(r.o)
    return replace(r, o=args.o)


def torch_module():
    import torch  # noqa: PLC0415 - the adapters need it, the package does not

    return torch


def fail(name, why):
    raise ValueError(f"{name}: {why}")


def refuse(name, value, why):
    """A ValueError naming the argument; a tensor is described, not printed (printing would
    read it from the device)."""
    what = f"a {type(value).__name__} of shape {list(value.shape)}" if hasattr(
        value, "shape") else repr(value)
    raise ValueError(f"{name}: {what} is not supported: {why}")


def check_unsupported(logit_cap=None, sinks=None, sliding_window=None, names=None):
    """Refuses what changes the result and verifyd does not compute. ``sliding_window`` is the
    window when there is one (each adapter reads its backend's "no window" value as None).
    ``names`` renames an argument to the backend's own spelling ({"sliding_window":
    "window_left"})."""
    names = names or {}
    cap_name = names.get("logit_cap", "logit_cap")
    if logit_cap is not None and _number(cap_name, logit_cap) > 0:
        refuse(cap_name, logit_cap, "verifyd applies no soft cap to the logits")
    if sinks is not None:
        refuse(names.get("sinks", "sinks"), sinks, "verifyd's softmax has no attention sinks")
    if sliding_window is not None:
        refuse(names.get("sliding_window", "sliding_window"), sliding_window,
               "verifyd's calls see the whole prefix (no sliding window)")


def kv_scale_of(pool, k_scale, v_scale, names=None):
    """The pool's scale as verifyd takes it (VerifyArgs.kv_scale). A bf16 pool: None, and a
    k_scale or v_scale other than 1 is refused. An e4m3 pool (torch.float8_e4m3fn, or numpy
    uint8 bits): k_scale, a host float that is finite and > 0 (the pool's values are
    e4m3 x k_scale), which v_scale must equal: V is the first 512 dims of the same stored rows,
    dequantised by the same scale. ``names``: the backend's spelling of the two, and of the pool
    ("pool")."""
    names = names or {}
    k_name, v_name = names.get("k_scale", "k_scale"), names.get("v_scale", "v_scale")
    if tensors.kv_dtype_of(names.get("pool", "k_buffer"), pool) != tensors.KV_E4M3:
        for name, value in ((k_name, k_scale), (v_name, v_scale)):
            if value is not None and not _is_one(value):
                refuse(name, value, "a bf16 pool takes no scale (an fp8 pool carries its k_scale)")
        return None
    if k_scale is None or hasattr(k_scale, "shape"):
        refuse(k_name, k_scale, "an fp8 pool's scale is needed as a host float (reading a "
                                "tensor would synchronise with the device)")
    k = float(k_scale)
    if not (math.isfinite(k) and k > 0):
        fail(k_name, f"{k} must be finite and > 0")
    if v_scale is not None and (hasattr(v_scale, "shape") or float(v_scale) != k):
        refuse(v_name, v_scale, f"verifyd reads V as the first 512 dims of the key rows, "
                                f"dequantised by {k_name} {k}; {v_name} must equal it")
    return k


def _number(name, x):
    if hasattr(x, "shape"):  # a tensor would need a read from the device to be judged
        fail(name, "a host number is expected, not a tensor")
    return float(x)


def _is_one(x):
    if hasattr(x, "shape"):
        return False  # a scale tensor: per-tensor scales need a device read; refused
    return float(x) == 1.0


def scale(sm_scale):
    """The softmax scale as given (DeepSeek's layer.scaling includes the YaRN factor): a finite
    host float > 0, never recomputed."""
    if sm_scale is None or hasattr(sm_scale, "shape"):
        fail("sm_scale", f"{type(sm_scale).__name__}: pass the layer's scaling as a host float")
    s = float(sm_scale)
    if not (math.isfinite(s) and s > 0):
        fail("sm_scale", f"{s} must be finite and > 0")
    return s


def shape(x):
    return tuple(int(d) for d in x.shape)


def check_tensor(name, x, dtypes, device=None):
    torch = torch_module()
    if not isinstance(x, torch.Tensor):
        fail(name, f"{type(x).__name__}: expected a torch tensor")
    if dtypes is not None and x.dtype not in dtypes:
        fail(name, f"dtype {x.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if device is not None and x.device != device:
        fail(name, f"on {x.device}, expected {device} (q's device)")
    return x


def int_tensor(name, x, shape_=None, device=None):
    """An index tensor (int32 or int64) of the expected shape, on q's device."""
    torch = torch_module()
    check_tensor(name, x, (torch.int32, torch.int64), device)
    if shape_ is not None and shape(x) != tuple(shape_):
        fail(name, f"shape {list(shape(x))}, expected {list(shape_)}")
    return x


def q_view(name, q, tokens=None, dim=HEAD_DIM_QK):
    """q as a [tokens, H, dim] bf16 view: from [tokens, H*dim], [tokens, H, dim] or
    [B, T, H, dim]."""
    torch = torch_module()
    check_tensor(name, q, (torch.bfloat16,))
    s = shape(q)
    if len(s) == 2:
        if s[1] % dim or s[1] == 0:
            fail(name, f"shape {list(s)}: dim 1 is not a multiple of {dim} (H*{dim})")
        s = (s[0], s[1] // dim, dim)
    elif len(s) == 4:
        s = (s[0] * s[1], s[2], s[3])
    elif len(s) != 3:
        fail(name, f"shape {list(shape(q))}, expected [tokens, H*{dim}] or [tokens, H, {dim}]")
    if s[2] != dim:
        fail(name, f"shape {list(shape(q))}: last dim {s[2]}, expected {dim}")
    if tokens is not None and s[0] != tokens:
        fail(name, f"shape {list(shape(q))}: {s[0]} tokens, expected B*T = {tokens}")
    try:
        return q.view(s)
    except RuntimeError:
        fail(name, f"shape {list(shape(q))} with strides {list(q.stride())} cannot be viewed "
                   f"as {list(s)}")


def o_view(o, tokens, heads, device):
    """The caller's output ([tokens, H*512] or [tokens, H, 512] bf16) as a [tokens, H, 512]
    view, or None."""
    if o is None:
        return None
    torch = torch_module()
    check_tensor("o", o, (torch.bfloat16,), device)
    want = (tokens, heads, HEAD_DIM_V)
    if shape(o) not in (want, (tokens, heads * HEAD_DIM_V)):
        fail("o", f"shape {list(shape(o))}, expected [{tokens}, {heads * HEAD_DIM_V}] or "
                  f"{list(want)}")
    if not o.is_contiguous():
        fail("o", f"strides {list(o.stride())}: must be contiguous (verifyd's rows are written "
                  f"into it in place)")
    return o.view(want)


def pool_view(name, pool, page_size=None):
    """A bf16 or float8_e4m3fn pool as [num_pages, page_size, 576]: from [slots, 576],
    [slots, 1, 576] (token slots, page size 1 unless ``page_size`` is given), [pages, page, 576]
    or [pages, page, 1, 576]."""
    torch = torch_module()
    check_tensor(name, pool, (torch.bfloat16, torch.float8_e4m3fn))
    s = shape(pool)
    if s[-1:] != (HEAD_DIM_QK,):
        fail(name, f"shape {list(s)}: last dim must be {HEAD_DIM_QK} (512 latent + 64 rope)")
    if len(s) == 4 and s[2] == 1:
        s = (s[0], s[1], HEAD_DIM_QK)
    elif len(s) == 2 or (len(s) == 3 and s[1] == 1):
        slots = s[0]
        page = page_size or 1
        if slots % page:
            fail(name, f"shape {list(shape(pool))}: {slots} slots are not whole pages of "
                       f"{page}")
        s = (slots // page, page, HEAD_DIM_QK)
    elif len(s) != 3:
        fail(name, f"shape {list(s)}, expected [slots, {HEAD_DIM_QK}], [slots, 1, "
                   f"{HEAD_DIM_QK}] or [pages, page_size, {HEAD_DIM_QK}]")
    if page_size is not None and s[1] != page_size:
        fail(name, f"shape {list(shape(pool))}: page size {s[1]}, expected {page_size}")
    try:
        return pool.view(s)
    except RuntimeError:
        fail(name, f"shape {list(shape(pool))} cannot be viewed as {list(s)}")


def layer_pool(name, pool, layer):
    """The pool tensor a call reads: ``pool`` itself, or member ``layer`` of a pool set
    (regions.PoolSet, as client.register_cuda_set returns it: a KV pool per layer, which the
    call then names by set and index)."""
    if isinstance(pool, PoolSet):
        if layer is None:
            fail("layer", f"needed with pool set '{pool.name}' as {name} (the index of the "
                          f"layer whose pool the call reads)")
        return pool.layer(layer)
    if layer is not None:
        fail("layer", f"{layer!r} given with a single {name} tensor; pass the pool set "
                      f"(client.register_cuda_set) as {name}")
    return pool


def mask_format(tree_mask, draft):
    return MASK_BYTES if shape(tree_mask)[2] == draft else MASK_BITS


def causal_mask(batch, draft, device, causal=True):
    """uint8 [B, T, T]: draft token i sees draft tokens j <= i (a chain of drafts, as a causal
    kernel aligned to the end of the sequence sees them), or all of them."""
    torch = torch_module()
    ones = torch.ones(draft, draft, dtype=torch.uint8, device=device)
    tri = torch.tril(ones) if causal else ones
    return tri.unsqueeze(0).expand(batch, draft, draft).contiguous()


def segments(lens, capacity):
    """Positions 0..capacity-1 of the concatenation of segments of lengths ``lens`` [S]:
    (indptr int64 [S+1], seg int64 [capacity], offset in the segment, used bool). Positions
    past indptr[S] are unused (seg clamped to S-1). ``capacity`` is a host bound >= sum(lens);
    nothing is read back to the host, so a CUDA graph can capture it."""
    torch = torch_module()
    device = lens.device
    count = lens.shape[0]
    indptr = torch.zeros(count + 1, dtype=torch.int64, device=device)
    indptr[1:] = torch.cumsum(lens.to(torch.int64), 0)
    pos = torch.arange(capacity, dtype=torch.int64, device=device)
    seg = torch.searchsorted(indptr[1:].contiguous(), pos, right=True).clamp_(max=count - 1)
    return indptr, seg, pos - indptr[seg], pos < indptr[count]


def take(src, idx):
    """src.reshape(-1)[idx], the index clamped into range (an unused or bad position reads a
    valid element instead of faulting; the values that matter are checked downstream)."""
    torch = torch_module()
    flat = src.reshape(-1)
    if flat.shape[0] == 0:
        return torch.zeros(idx.shape, dtype=src.dtype, device=src.device)
    return flat[idx.clamp(0, flat.shape[0] - 1)]
