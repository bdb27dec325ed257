#!/usr/bin/env python3
"""verifyd_client.adapters: SGLang's three target-verify attention backends (Triton,
FlashInfer MLA, FlashMLA) converted to verifyd's verify arguments.

Each backend's arguments are built in torch from seeded random inputs in that backend's own
layout (odd sizes: B = 3, T = 5 and 7, H = 3, prefixes of different lengths, FlashMLA's
64-token pages with -1 padding), converted with the adapter's verify_args, and checked twice
against fp32 torch attention written here: once computed from the backend's own arguments the
way its kernel reads them, once from the converted arguments the way verifyd reads them
(README.md, "The computation"), rounded to bf16 as verifyd serves it. fp8 pools (Triton,
FlashInfer MLA) carry their k_scale through. Also: 2-D q, o written
in place, every refused argument and bad shapes raise ValueError naming the argument, and on
CUDA the conversion makes no host synchronisation (torch's sync debug mode) and is captured
in a CUDA graph. With VERIFYD_BIN (run_tests.py sets it) each adapter's eager run also goes
through a real verifyd (VERIFYD_TEST_ENGINE=cuda: its CUDA engine).

Runs on CPU torch, and on CUDA too when available; skipped without torch.
  python3 tests/python/test_adapters.py            (or run_tests.py VERIFYD_BIN test_adapters)
"""

import importlib.util
import math
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python")), HERE]

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch

    from verifyd_client.adapters import VerifyArgs, flashinfer_mla, flashmla, run, triton

# DeepSeek-V3's layer.scaling: 1/sqrt(192) times the YaRN mscale squared (0.1 * ln(40) + 1).
SCALE = (1 / math.sqrt(192)) * (0.1 * math.log(40) + 1) ** 2
TOL = 5e-3
B, H = 3, 3
PREFIXES = (37, 0, 130)


def devices():
    out = ["cpu"]
    if HAVE_TORCH and torch.cuda.is_available():
        out.append("cuda")
    return out


def rel_l2(got, want):
    want = want.double().to(got.device)
    return float((got.double() - want).norm() / want.norm())


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen).bfloat16()


def random_tree(gen, batch, draft):
    """bool [B, T, T]: a random draft tree; draft i sees itself and its ancestors."""
    tree = torch.zeros(batch, draft, draft, dtype=torch.bool)
    for b in range(batch):
        for i in range(draft):
            tree[b, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                tree[b, i] |= tree[b, parent]
    return tree


def attend(q, keys, visible, scale):
    """fp32 MLA attention: q [T, H, 576], keys [L, 576] (V = their first 512 dims), visible
    [T, L] bool -> o [T, H, 512]. Logits split into the latent and rope parts, as the MLA
    kernels take them."""
    q, keys = q.float(), keys.float()
    s = (torch.einsum("thd,ld->thl", q[..., :512], keys[:, :512]) +
         torch.einsum("thd,ld->thl", q[..., 512:], keys[:, 512:])) * scale
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("thl,ld->thd", torch.softmax(s, dim=-1), keys[:, :512])


def chain(prefix, draft, causal=True):
    """[T, prefix + T]: a causal kernel's mask aligned to the end of the sequence."""
    n = prefix + draft
    if not causal:
        return torch.ones(draft, n, dtype=torch.bool)
    return torch.arange(n)[None, :] <= prefix + torch.arange(draft)[:, None]


def as_verifyd(args):
    """What verifyd computes from VerifyArgs, rounded to bf16: o [B*T, H, 512] fp32."""
    assert isinstance(args, VerifyArgs)
    pool = args.kv_pool.cpu().float() * (1.0 if args.kv_scale is None else args.kv_scale)
    indptr, indices = args.kv_indptr.cpu().tolist(), args.kv_indices.cpu()
    lens, draft = args.kv_lens.cpu().tolist(), args.draft
    mask = args.tree_mask.cpu()
    if args.mask_format == "bits":
        cols = torch.arange(draft)
        mask = (mask[:, :, cols // 8].long() >> (cols % 8)) & 1
    q = args.q.cpu()
    out = []
    for b in range(args.batch):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        keys = pool[pages].reshape(-1, 576)[:lens[b]]
        visible = torch.ones(draft, lens[b], dtype=torch.bool)
        visible[:, lens[b] - draft:] = mask[b].bool()
        out.append(attend(q[b * draft:(b + 1) * draft], keys, visible, args.sm_scale))
    return torch.cat(out).bfloat16().float()


# ---- Triton: extend_attention_fwd's arguments and what its kernel reads of them ----

def triton_call(seed, draft, mode="full", device="cpu", graph_buffers=False):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.tensor(PREFIXES)
    total = int(prefix.sum())
    slots = total + B * draft + 41
    perm = torch.randperm(slots, generator=gen)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(prefix, 0)
    kv_indices = perm[:total].long()
    tree = random_tree(gen, B, draft)
    if mode == "full":
        blocks = [torch.cat([torch.ones(draft, int(p), dtype=torch.bool), tree[b]], 1).reshape(-1)
                  for b, p in enumerate(prefix.tolist())]
        mask = torch.cat(blocks)
        mask_indptr = torch.zeros(B + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(torch.tensor([len(x) for x in blocks]), 0)
    elif mode == "qlen":
        mask, mask_indptr = tree.reshape(-1), None
    else:  # one little-endian item per row, 8, 16 or 32 bits as SGLang picks them
        dtype = torch.uint8 if draft <= 8 else torch.int16 if draft <= 16 else torch.int32
        weights = (1 << torch.arange(draft, dtype=torch.int64))
        mask, mask_indptr = (tree.long() * weights).sum(-1).reshape(-1).to(dtype), None
    if graph_buffers:  # the CUDA-graph buffers: uint8 mask and kv_indices longer than a step
        junk = torch.randint(0, slots, (97,), generator=gen)
        kv_indices = torch.cat([kv_indices, junk])
        if mode != "qlen_packed":
            mask = torch.cat([mask.to(torch.uint8), torch.randint(0, 2, (300,), generator=gen,
                                                                  dtype=torch.uint8)])
    call = {"q": randn(gen, B * draft, H * 576), "k_buffer": randn(gen, slots, 1, 576),
            "kv_indptr": kv_indptr, "kv_indices": kv_indices,
            "out_cache_loc": perm[total:total + B * draft].long(), "custom_mask": mask,
            "mask_indptr": mask_indptr,
            "qo_indptr": torch.arange(0, (B + 1) * draft, draft, dtype=torch.int32)}
    return {k: None if v is None else v.to(device) for k, v in call.items()}


def triton_reference(call, mode, sm_scale):
    """The Triton kernel's reading: prefix slots then out_cache_loc, the mask's draft columns
    (the prefix columns are skipped), in the given layout."""
    q = call["q"].cpu().reshape(-1, H, 576)
    k_all = call["k_buffer"].cpu().reshape(-1, 576)
    indptr = call["kv_indptr"].cpu().tolist()
    loc, mask = call["out_cache_loc"].cpu(), call["custom_mask"].cpu()
    draft = q.shape[0] // B
    out = []
    for b in range(B):
        prefix = indptr[b + 1] - indptr[b]
        slots = torch.cat([call["kv_indices"].cpu()[indptr[b]:indptr[b + 1]],
                           loc[b * draft:(b + 1) * draft]])
        visible = torch.ones(draft, prefix + draft, dtype=torch.bool)
        if mode == "full":
            start = int(call["mask_indptr"][b])
            block = mask[start:start + draft * (prefix + draft)].reshape(draft, -1)
            visible[:, prefix:] = block[:, prefix:] != 0
        elif mode == "qlen":
            visible[:, prefix:] = mask[b * draft * draft:(b + 1) * draft * draft].reshape(
                draft, draft) != 0
        else:
            rows = mask[b * draft:(b + 1) * draft].long()
            visible[:, prefix:] = ((rows[:, None] >> torch.arange(draft)) & 1) != 0
        out.append(attend(q[b * draft:(b + 1) * draft], k_all[slots.long()], visible, sm_scale))
    return torch.cat(out)


# ---- FlashInfer MLA: plan() and run() arguments, and the paged MLA kernel's reading ----

def flashinfer_call(seed, draft, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(PREFIXES) + draft
    slots = int(lens.sum()) + 29
    perm = torch.randperm(slots, generator=gen).to(torch.int32)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    # req_to_token's prefix and draft slots, in a buffer longer than the step (CUDA graph)
    kv_indices = torch.cat([perm[:int(lens.sum())], torch.randint(0, slots, (53,),
                                                                  generator=gen).int()])
    call = {"q": randn(gen, B * draft, H * 512), "q_rope": randn(gen, B * draft, H * 64),
            "k_buffer": randn(gen, slots, 1, 576), "kv_indptr": kv_indptr,
            "kv_indices": kv_indices, "kv_len_arr": lens.to(torch.int32),
            "qo_indptr": torch.arange(0, (B + 1) * draft, draft, dtype=torch.int32)}
    return {k: v.to(device) for k, v in call.items()}


def flashinfer_reference(call, sm_scale, causal=True, page_size=1):
    q = torch.cat([call["q"].cpu().reshape(-1, H, 512), call["q_rope"].cpu().reshape(-1, H, 64)],
                  -1)
    pages = call["k_buffer"].cpu().reshape(-1, page_size, 576)
    qo, kv = call["qo_indptr"].cpu().tolist(), call["kv_indptr"].cpu().tolist()
    lens = call["kv_len_arr"].cpu().tolist()
    out = []
    for b in range(B):
        keys = pages[call["kv_indices"].cpu()[kv[b]:kv[b + 1]].long()].reshape(-1, 576)
        keys = keys[:lens[b]]
        draft = qo[b + 1] - qo[b]
        out.append(attend(q[qo[b]:qo[b + 1]], keys, chain(lens[b] - draft, draft, causal),
                          sm_scale))
    return torch.cat(out)


# ---- FlashMLA: flash_mla_with_kvcache's arguments and its reading ----

def flashmla_call(seed, draft, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(PREFIXES) + draft
    need = (lens + 63) // 64
    max_pages = int(need.max()) + 1  # a padded column for every request
    num_pages = int(need.sum()) + 5
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need.tolist()):
        table[b, :n] = perm[at:at + n]
        at += n
    call = {"q": randn(gen, B, draft, H, 576), "k_cache": randn(gen, num_pages, 64, 1, 576),
            "block_table": table, "cache_seqlens": lens.to(torch.int32)}
    return {k: v.to(device) for k, v in call.items()}


def flashmla_reference(call, sm_scale, causal=True):
    q = call["q"].cpu()
    k_cache = call["k_cache"].cpu().reshape(-1, 64, 576)
    draft = q.shape[1]
    out = []
    for b in range(B):
        n = int(call["cache_seqlens"][b])
        pages = call["block_table"].cpu()[b, :(n + 63) // 64].long()
        keys = k_cache[pages].reshape(-1, 576)[:n]
        out.append(attend(q[b], keys, chain(n - draft, draft, causal), sm_scale))
    return torch.cat(out)


class FakeClient:
    """client.verify computed as verifyd computes it, checking what run() hands it."""

    def __init__(self, test):
        self.test = test

    def verify(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
               mask_format=None, kv_scale=None, **_):
        self.test.assertEqual(kv_indices.shape[0], int(kv_indptr[-1]))  # cut to kv_indptr[B]
        batch = kv_lens.shape[0]
        args = VerifyArgs(q=q, kv_pool=kv_pool, kv_indptr=kv_indptr, kv_indices=kv_indices,
                          kv_lens=kv_lens, tree_mask=tree_mask, mask_format=mask_format,
                          sm_scale=sm_scale, o=None, batch=batch, draft=q.shape[0] // batch,
                          kv_scale=kv_scale)
        from verifyd_client.result import VerifyResult  # noqa: PLC0415

        o = as_verifyd(args).bfloat16().to(q.device)
        return VerifyResult(o=o, lse=None, served_path="reference", mode="shadow",
                            comparison=None)


def convert(backend, call, **kw):
    if backend == "triton":
        return triton.verify_args(**call, **kw)
    if backend == "flashinfer_mla":
        return flashinfer_mla.verify_args(**call, **kw)
    return flashmla.verify_args(**call, **kw)


def make(backend, seed, draft, device, **kw):
    if backend == "triton":
        call = triton_call(seed, draft, device=device, **kw)
        return call, {"sm_scale": SCALE}
    if backend == "flashinfer_mla":
        return flashinfer_call(seed, draft, device), {"sm_scale": SCALE}
    return flashmla_call(seed, draft, device), {"softmax_scale": SCALE}


def reference(backend, call, mode="full"):
    if backend == "triton":
        return triton_reference(call, mode, SCALE)
    if backend == "flashinfer_mla":
        return flashinfer_reference(call, SCALE)
    return flashmla_reference(call, SCALE)


BACKENDS = ("triton", "flashinfer_mla", "flashmla")


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class AdapterTest(unittest.TestCase):
    def check(self, args, want, what):
        got = as_verifyd(args)
        err = rel_l2(got, want.reshape(got.shape))
        self.assertLess(err, TOL, f"{what}: rel-L2 {err:.2e}")

    def test_triton_every_mask_layout(self):
        seed = 100
        for device in devices():
            for draft in (5, 7):
                for mode in ("full", "qlen", "qlen_packed"):
                    for graph in (False, True):
                        seed += 1
                        with self.subTest(device=device, draft=draft, mode=mode, graph=graph):
                            call = triton_call(seed, draft, mode, device, graph_buffers=graph)
                            args = triton.verify_args(**call, sm_scale=SCALE,
                                                      tree_mask_mode=mode)
                            self.assertEqual((args.batch, args.draft), (B, draft))
                            self.assertEqual(args.mask_format,
                                             "bits" if mode == "qlen_packed" else "bytes")
                            self.assertEqual(args.kv_indices.dtype, torch.int32)
                            self.assertEqual(args.kv_indices.shape[0],
                                             call["kv_indices"].shape[0] + B * draft)
                            self.check(args, triton_reference(call, mode, SCALE),
                                       f"triton {mode} seed {seed}")

    def test_triton_mask_modes_by_sglang_number_and_computed_mask_indptr(self):
        call = triton_call(7, 5, "full")
        want = triton_reference(call, "full", SCALE)
        for kw in ({"tree_mask_mode": 0}, {"mask_indptr": None}):
            args = triton.verify_args(**dict(call, **kw), sm_scale=SCALE)
            self.check(args, want, str(kw))
        packed = triton_call(8, 7, "qlen_packed")
        args = triton.verify_args(**packed, sm_scale=SCALE, tree_mask_mode=2)
        self.assertEqual(args.mask_format, "bits")
        # No mask: the drafts are a chain.
        args = triton.verify_args(**dict(call, custom_mask=None), sm_scale=SCALE)
        self.assertTrue(torch.equal(args.tree_mask[0], torch.tril(torch.ones(5, 5)).byte()))

    def test_triton_kv_bound(self):
        call = triton_call(9, 5, "full", graph_buffers=True)
        total = int(call["kv_indptr"][-1])
        args = triton.verify_args(**call, sm_scale=SCALE, kv_bound=total)
        self.assertEqual(args.kv_indices.shape[0], total + B * 5)
        self.check(args, triton_reference(call, "full", SCALE), "kv_bound")

    def test_flashinfer_mla(self):
        seed = 200
        for device in devices():
            for draft in (5, 7):
                seed += 1
                with self.subTest(device=device, draft=draft):
                    call = flashinfer_call(seed, draft, device)
                    want = flashinfer_reference(call, SCALE)
                    args = flashinfer_mla.verify_args(**call, sm_scale=SCALE)
                    self.assertTrue(args.kv_indices.data_ptr() == call["kv_indices"].data_ptr())
                    self.check(args, want, "q_nope + q_rope")
                    # forward_extend without q_rope: one [tokens, H*576] q.
                    whole = torch.cat([call["q"].reshape(-1, H, 512),
                                       call["q_rope"].reshape(-1, H, 64)], -1).reshape(-1, H * 576)
                    args = flashinfer_mla.verify_args(**dict(call, q=whole, q_rope=None),
                                                      sm_scale=SCALE)
                    self.assertEqual(args.q.data_ptr(), whole.data_ptr())  # a view
                    self.check(args, want, "q [tokens, H*576]")
                    no_lens = dict(call, kv_len_arr=None)
                    self.check(flashinfer_mla.verify_args(**no_lens, sm_scale=SCALE), want,
                               "kv_len_arr from kv_indptr")
                    full = flashinfer_reference(call, SCALE, causal=False)
                    self.check(flashinfer_mla.verify_args(**call, sm_scale=SCALE, causal=False),
                               full, "causal=False")

    def test_flashmla(self):
        seed = 300
        for device in devices():
            for draft in (5, 7):
                seed += 1
                with self.subTest(device=device, draft=draft):
                    call = flashmla_call(seed, draft, device)
                    want = flashmla_reference(call, SCALE)
                    args = flashmla.verify_args(**call, softmax_scale=SCALE,
                                                tile_scheduler_metadata=object(), num_splits=1)
                    self.assertEqual(args.kv_pool.shape[1:], (64, 576))
                    self.assertEqual(args.q.data_ptr(), call["q"].data_ptr())
                    self.assertEqual(args.kv_indices.shape[0], call["block_table"].numel())
                    self.assertGreaterEqual(int(args.kv_indices.min()), 0)  # no -1 read
                    self.check(args, want, "q [B, T, H, 576]")
                    flat = dict(call, q=call["q"].reshape(B * draft, H * 576),
                                k_cache=call["k_cache"].reshape(-1, 1, 576))
                    self.check(flashmla.verify_args(**flat, softmax_scale=SCALE), want,
                               "2-D q, the pool's [slots, 1, 576]")

    def test_the_real_scale_passes_through(self):
        for backend in BACKENDS:
            call, scale = make(backend, 11, 5, "cpu")
            args = convert(backend, call, **scale)
            self.assertEqual(args.sm_scale, SCALE)
            self.assertNotAlmostEqual(args.sm_scale, 1 / math.sqrt(192), places=3)

    def test_a_pool_set_and_a_layer(self):
        """A pool per layer (client.register_cuda_set's PoolSet; here of unregistered tensors):
        the adapter reads the named layer's pool, and a missing, out-of-range or stray layer is
        refused naming ``layer``."""
        from verifyd_client.regions import PoolSet  # noqa: PLC0415

        pool_arg = {"triton": "k_buffer", "flashinfer_mla": "k_buffer", "flashmla": "k_cache"}
        for device in devices():
            for backend in BACKENDS:
                with self.subTest(device=device, backend=backend):
                    call, scale = make(backend, 15, 5, device)
                    name = pool_arg[backend]
                    real = call[name]
                    # Layers of the call's shape, layer 2 the call's pool, the others zeros.
                    layers = [torch.zeros_like(real) for _ in range(4)]
                    layers[2] = real
                    pools = PoolSet("layers", layers)
                    args = convert(backend, dict(call, **{name: pools}), **scale, layer=2)
                    self.assertEqual(args.layer, 2)
                    self.assertEqual(args.kv_pool.data_ptr(), real.data_ptr())
                    self.check(args, reference(backend, call), "layer 2 of a pool set")
                    wrong = convert(backend, dict(call, **{name: pools}), **scale, layer=1)
                    self.assertEqual(wrong.kv_pool.data_ptr(), layers[1].data_ptr())
                    self.assertIsNone(convert(backend, call, **scale).layer)
                    for bad, why in ((None, "needed with pool set 'layers'"),
                                     (4, "4 is out of range for pool set 'layers' \\(4 "
                                         "members, 0 to 3\\)"),
                                     (-1, "-1 is out of range"), ("2", "is not an int")):
                        with self.assertRaisesRegex(ValueError, f"^layer: .*{why}"):
                            convert(backend, dict(call, **{name: pools}), **scale, layer=bad)
                    with self.assertRaisesRegex(ValueError, f"^layer: 2 given with a single "
                                                            f"{name} tensor"):
                        convert(backend, call, **scale, layer=2)

    def test_o_is_written_in_place(self):
        for device in devices():
            for backend in BACKENDS:
                with self.subTest(device=device, backend=backend):
                    call, scale = make(backend, 12, 7, device)
                    o = torch.zeros(B * 7, H * 512, dtype=torch.bfloat16, device=device)
                    args = convert(backend, call, **scale, o=o)
                    self.assertEqual(args.o.shape, (B * 7, H, 512))
                    self.assertEqual(args.o.data_ptr(), o.data_ptr())
                    r = run(FakeClient(self), args)
                    self.assertIs(r.o, args.o)
                    err = rel_l2(o.float().reshape(B * 7, H, 512), reference(backend, call))
                    self.assertLess(err, TOL)
                    self.assertIsNone(convert(backend, call, **scale).o)

    def test_refused_arguments_are_named(self):
        refused = {
            "triton": {"k_scale": 0.5, "v_scale": 2.0, "logit_cap": 30.0,
                       "sliding_window_size": 128, "sinks": torch.zeros(H),
                       "xai_temperature_len": 8, "skip_prefix_custom_mask": False,
                       "v_buffer": torch.zeros(5, 1, 512, dtype=torch.bfloat16)},
            "flashinfer_mla": {"k_scale": 0.5, "v_scale": 2.0, "logit_cap": 30.0,
                               "window_left": 127, "sinks": torch.zeros(H)},
            "flashmla": {"k_scale": torch.ones(1), "v_scale": 0.5, "logit_cap": 30.0,
                         "sliding_window_size": 64, "attn_sink": torch.zeros(H),
                         "descale_q": torch.ones(1), "descale_k": torch.ones(1),
                         "indices": torch.zeros(B, 5, 8, dtype=torch.int32),
                         "is_fp8_kvcache": True},
        }
        for backend, cases in refused.items():
            call, scale = make(backend, 13, 5, "cpu")
            convert(backend, call, **scale)  # the defaults are accepted
            for name, value in cases.items():
                with self.subTest(backend=backend, argument=name):
                    with self.assertRaisesRegex(ValueError, f"^{name}: .*not supported"):
                        convert(backend, call, **scale, **{name: value})

    def test_fp8_pools_carry_their_scale(self):
        """A float8_e4m3fn pool with k_scale (= v_scale): the VerifyArgs name the scale, and
        verifyd's reading of them (e4m3 x k_scale) matches the backend's reading of the same
        pool. A scale verifyd cannot take is refused, naming it."""
        kv = 0.37
        for device in devices():
            for backend in ("triton", "flashinfer_mla"):
                with self.subTest(device=device, backend=backend):
                    call, scale = make(backend, 31, 5, device)
                    fp8 = (call["k_buffer"].float() / kv).to(torch.float8_e4m3fn)
                    call["k_buffer"] = fp8
                    args = convert(backend, call, **scale, k_scale=kv, v_scale=kv)
                    self.assertEqual(args.kv_scale, kv)
                    self.assertEqual(args.kv_pool.dtype, torch.float8_e4m3fn)
                    dequantised = dict(call, k_buffer=fp8.float() * kv)
                    # the backend's reading of the same pool: e4m3 x k_scale in fp32
                    self.check(args, reference(backend, dequantised), f"{backend} fp8")
                    out = run(FakeClient(self), args)
                    err = rel_l2(out.o.float().cpu().reshape(-1, H, 512),
                                 reference(backend, dequantised))
                    self.assertLess(err, TOL)
                    for kw, name in (({"k_scale": kv, "v_scale": 0.5}, "v_scale"),
                                     ({"k_scale": torch.tensor(kv), "v_scale": kv}, "k_scale"),
                                     ({"k_scale": None, "v_scale": None}, "k_scale"),
                                     ({"k_scale": float("nan"), "v_scale": kv}, "k_scale"),
                                     ({"k_scale": -1.0, "v_scale": -1.0}, "k_scale")):
                        with self.assertRaisesRegex(ValueError, f"^{name}: "):
                            convert(backend, call, **scale, **kw)
                    # a bf16 pool takes no scale
                    bf16, _ = make(backend, 31, 5, device)
                    with self.assertRaisesRegex(ValueError, "^k_scale: .*bf16 pool"):
                        convert(backend, bf16, **scale, k_scale=kv, v_scale=kv)
        call, scale = make("flashmla", 31, 5, "cpu")
        call["k_cache"] = call["k_cache"].float().to(torch.float8_e4m3fn)
        with self.assertRaisesRegex(ValueError, "^k_cache: .*bf16"):
            flashmla.verify_args(**call, **scale)

    def test_bad_shapes_name_the_field(self):
        t_call, _ = make("triton", 14, 5, "cpu")
        f_call, _ = make("flashinfer_mla", 14, 5, "cpu")
        m_call, _ = make("flashmla", 14, 5, "cpu")
        bf16 = torch.bfloat16
        cases = [
            ("triton", t_call, {"q": t_call["q"][:, :-1]}, "q"),
            ("triton", t_call, {"q": t_call["q"][:-1]}, "q"),
            ("triton", t_call, {"q": t_call["q"].float()}, "q"),
            ("triton", t_call, {"k_buffer": t_call["k_buffer"][:60].reshape(30, 2, 576)},
             "k_buffer"),
            ("triton", t_call, {"k_buffer": t_call["k_buffer"].float()}, "k_buffer"),
            ("triton", t_call, {"out_cache_loc": t_call["out_cache_loc"][:-1]}, "out_cache_loc"),
            ("triton", t_call, {"kv_indptr": t_call["kv_indptr"][:1]}, "kv_indptr"),
            ("triton", t_call, {"kv_indices": t_call["kv_indices"].float()}, "kv_indices"),
            ("triton", t_call, {"qo_indptr": t_call["qo_indptr"][:-1]}, "qo_indptr"),
            ("triton", t_call, {"mask_indptr": t_call["mask_indptr"][:-1]}, "mask_indptr"),
            ("triton", t_call, {"custom_mask": t_call["custom_mask"].float()}, "custom_mask"),
            ("triton", t_call, {"custom_mask": t_call["custom_mask"][:10],
                                "tree_mask_mode": "qlen"}, "custom_mask"),
            ("triton", t_call, {"custom_mask": torch.zeros(B * 5, dtype=torch.uint8),
                                "tree_mask_mode": "qlen_packed", "q": t_call["q"]},
             None),  # 5 columns fit in a byte: accepted
            ("triton", t_call, {"tree_mask_mode": "tree"}, "tree_mask_mode"),
            ("triton", t_call, {"o": torch.zeros(B * 5, H * 576, dtype=bf16)}, "o"),
            ("triton", t_call, {"o": torch.zeros(B * 5, H, 512)}, "o"),
            ("triton", t_call, {"o": torch.zeros(H * 512, B * 5, dtype=bf16).t()}, "o"),
            ("triton", t_call, {"sm_scale": torch.tensor(SCALE)}, "sm_scale"),
            ("triton", t_call, {"sm_scale": 0.0}, "sm_scale"),
            ("flashinfer_mla", f_call, {"q_rope": f_call["q_rope"][:, :128]}, "q_rope"),
            ("flashinfer_mla", f_call, {"q_rope": f_call["q_rope"][:-1]}, "q_rope"),
            ("flashinfer_mla", f_call, {"kv_len_arr": f_call["kv_len_arr"][:-1]}, "kv_len_arr"),
            ("flashinfer_mla", f_call, {"kv_len_arr": None, "page_size": 2}, "kv_len_arr"),
            ("flashinfer_mla", f_call, {"k_buffer": f_call["k_buffer"].half()}, "k_buffer"),
            ("flashmla", m_call, {"block_table": m_call["block_table"][0]}, "block_table"),
            ("flashmla", m_call, {"cache_seqlens": m_call["cache_seqlens"][:-1]},
             "cache_seqlens"),
            ("flashmla", m_call, {"k_cache": m_call["k_cache"].reshape(-1, 32, 1, 576)},
             "k_cache"),
            ("flashmla", m_call, {"head_dim_v": 128}, "head_dim_v"),
        ]
        for backend, call, change, field in cases:
            scale = {"softmax_scale": SCALE} if backend == "flashmla" else {"sm_scale": SCALE}
            kw = dict(scale, **dict(call, **change))
            with self.subTest(backend=backend, field=field, change=sorted(change)):
                if field is None:
                    convert(backend, {}, **kw)
                    continue
                with self.assertRaisesRegex(ValueError, f"^{field}: "):
                    convert(backend, {}, **kw)
        # A bit-packed row of T = 9 does not fit in a byte.
        packed = triton_call(15, 9, "qlen_packed")
        with self.assertRaisesRegex(ValueError, "^custom_mask: .*9 bits"):
            triton.verify_args(**dict(packed, custom_mask=packed["custom_mask"].to(torch.uint8)),
                               sm_scale=SCALE, tree_mask_mode="qlen_packed")

    @unittest.skipUnless(HAVE_TORCH and torch.cuda.is_available(), "no CUDA device")
    def test_no_host_synchronisation_and_cuda_graph_capture(self):
        for backend in BACKENDS:
            with self.subTest(backend=backend):
                call, scale = make(backend, 16, 7, "cuda")
                o = torch.zeros(B * 7, H * 512, dtype=torch.bfloat16, device="cuda")
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    eager = convert(backend, call, **scale, o=o)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up before the capture, as torch asks
                    convert(backend, call, **scale, o=o)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = convert(backend, call, **scale, o=o)
                # New values in the same buffers, then a replay: the graph's outputs follow.
                fresh, _ = make(backend, 17, 7, "cuda")
                for k, v in fresh.items():
                    if v is not None and call[k] is not None:
                        call[k].copy_(v)
                graph.replay()
                torch.cuda.synchronize()
                want = convert(backend, call, **scale)
                for field in ("q", "kv_pool", "kv_indptr", "kv_indices", "kv_lens", "tree_mask"):
                    self.assertTrue(torch.equal(getattr(captured, field), getattr(want, field)),
                                    field)
                self.check(captured, reference(backend, call), "replayed graph")
                self.assertEqual(captured.o.data_ptr(), o.data_ptr())
                del eager


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
@unittest.skipUnless(os.environ.get("VERIFYD_BIN"), "VERIFYD_BIN is not set")
class EagerThroughVerifydTest(unittest.TestCase):
    """Each adapter's run() through a real verifyd; VERIFYD_TEST_ENGINE=cuda uses its CUDA
    engine (the tensors then live on the GPU)."""

    @classmethod
    def setUpClass(cls):
        from verifyd_client import VerifyClient  # noqa: PLC0415
        from verifyd_daemon import Daemon  # noqa: PLC0415

        cuda = os.environ.get("VERIFYD_TEST_ENGINE") == "cuda" and torch.cuda.is_available()
        cls.device = "cuda" if cuda else "cpu"
        cls.daemon = Daemon(*(["--engine=cuda"] if cuda else []))
        cls.client = VerifyClient(cls.daemon.data, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.stop()

    def test_each_backend(self):
        seed = 400
        for backend in BACKENDS:
            for draft in (5, 7):
                seed += 1
                with self.subTest(backend=backend, draft=draft):
                    call, scale = make(backend, seed, draft, self.device)
                    o = torch.zeros(B * draft, H * 512, dtype=torch.bfloat16, device=self.device)
                    args = convert(backend, call, **scale, o=o)
                    r = run(self.client, args, compare_sync=True, request_id=f"{backend}-{seed}")
                    self.assertIs(r.o, args.o)
                    err = rel_l2(o.float().cpu().reshape(B * draft, H, 512),
                                 reference(backend, call))
                    self.assertLess(err, TOL, f"{backend}: rel-L2 {err:.2e}")
        for backend in ("triton", "flashinfer_mla"):  # an fp8 pool, its k_scale through verifyd
            with self.subTest(backend=backend, kv="e4m3"):
                call, scale = make(backend, seed + 7, 5, self.device)
                fp8 = (call["k_buffer"].float() / 0.37).to(torch.float8_e4m3fn)
                call["k_buffer"] = fp8
                r = run(self.client, convert(backend, call, **scale, k_scale=0.37, v_scale=0.37),
                        compare_sync=True, request_id=f"{backend}-fp8")
                want = reference(backend, dict(call, k_buffer=fp8.float() * 0.37))
                err = rel_l2(r.o.float().cpu().reshape(-1, H, 512), want)
                self.assertLess(err, TOL, f"{backend} fp8: rel-L2 {err:.2e}")
        packed = triton_call(seed + 1, 7, "qlen_packed", self.device)
        r = run(self.client, triton.verify_args(**packed, sm_scale=SCALE,
                                                tree_mask_mode="qlen_packed"))
        self.assertLess(rel_l2(r.o.float().cpu(), triton_reference(packed, "qlen_packed", SCALE)),
                        TOL)

    def test_a_padded_page_that_is_read_is_refused(self):
        from verifyd_client import InvalidBundleError  # noqa: PLC0415

        call, _ = make("flashmla", 450, 5, self.device)
        call["block_table"][0, 0] = -1
        args = flashmla.verify_args(**call, softmax_scale=SCALE)
        with self.assertRaisesRegex(InvalidBundleError, "kv_indices"):
            run(self.client, args)


if __name__ == "__main__":
    unittest.main(verbosity=2)
