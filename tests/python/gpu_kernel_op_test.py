#!/usr/bin/env python3
"""The custom kernel in the serving process (VerifyKernel over libverifyd_kernel.so), on a GPU,
against the fp64 oracle of the contract (random_bundles.py):

    VERIFYD_CLIENT_GEN=... VERIFYD_KERNEL_LIB=.../libverifyd_kernel.so \\
        python3 tests/python/gpu_kernel_op_test.py [--json OUT]

- eager calls on ragged batches (prefixes off the tile grid), page sizes 1, 16 and 64, both
  mask formats, with and without lse: every output within bf16 rounding of the oracle, and
  `failed` False;
- one call captured in a CUDA graph, replayed with new q, pages, prefixes and masks written into
  its buffers before each replay: every replay checked;
- each of these with the checks inside the kernel (VERIFYD_OP_CHECKS=kernel) and in kernels
  around it (separate); an unknown VERIFYD_OP_CHECKS is refused naming it;
- an e4m3 pool (kv_scale 0.37) through v3e, eager and replayed, against the oracle of its values,
  and a page id past the pool failing the call;
- bad calls, eager and replayed, both mask formats, both placements of the checks: a page id past
  the pool (early, and the last request's last), a kv_len past max_kv_len, a falling kv_indptr, a
  mask byte of 2 or a bit past T, a NaN in q: `failed` True, with the separate checks o left as
  it was (but for the NaN, whose output is written and flagged), and the next good call passes;
- the switch (switch.py) in a captured step of 4 layers, with a conditional node a layer, one a
  step (Switch.step) and the kernel-side branch: mode stack, mode op, a rollback taking effect at the next replay, an op
  call that fails its check and one whose output is not finite, both served by the stack, a
  canary of 0.3 drawn per step (every layer of a step on one path), and a lease that is not
  renewed falling back to the stack within twice its period;
- the cost in a captured step of 61 layers: the step's time per layer, the kernels' device time
  (CUPTI, through torch.profiler: the spans of the custom kernel and its split combine, which
  overlap, counted once (cuda_timing.device_us), and the two check kernels', which run alone
  before and after it: the op's overhead), and what each
  switch adds to a layer in mode op (over the op called directly) and in mode stack (over a
  stand-in of the stack's attention called directly).

Exit status: 0 passed, 1 a check failed, 2 the setup failed.
"""

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))
sys.path[:0] = [CLIENT, HERE, os.path.normpath(os.path.join(HERE, "..", "..", "bench"))]

try:
    import numpy as np
    import torch
    import cuda_timing
    from random_bundles import SM_SCALE, oracle, random_bundle, rel_l2
    from verifyd_client import from_bf16
    from verifyd_client.errors import InvalidBundleError
    from verifyd_client.kernel_op import VerifyKernel
    from verifyd_client.switch import Switch
    from verifyd_client.tensors import pack_mask, to_e4m3
except ImportError as e:
    print(f"SETUP FAILED: {e}")
    sys.exit(2)

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


class Buffers:
    """Device buffers of one geometry, sized for the largest bundle, that calls (and a captured
    graph) read: a bundle is written into them before each call."""

    def __init__(self, batch, draft, heads, page_size, pool_pages, max_indices, bits, lse):
        dev = "cuda"
        rows = batch * draft
        self.q = torch.empty(rows, heads, 576, dtype=torch.bfloat16, device=dev)
        self.pool = torch.zeros(pool_pages, page_size, 576, dtype=torch.bfloat16, device=dev)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(max_indices, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        row = (draft + 7) // 8 if bits else draft
        self.mask = torch.zeros(batch, draft, row, dtype=torch.uint8, device=dev)
        self.o = torch.zeros(rows, heads, 512, dtype=torch.bfloat16, device=dev)
        self.lse = torch.zeros(rows, heads, dtype=torch.float32, device=dev) if lse else None
        self.bits = bits

    def load(self, b):
        def bf16(a):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)

        def i32(a):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))

        self.q.copy_(bf16(b["q"]).view(self.q.shape))
        raw = np.ascontiguousarray(b["kv_pool"])
        pool = torch.from_numpy(raw) if raw.dtype == np.uint8 else bf16(raw)  # e4m3 codes
        self.pool[:pool.shape[0]].copy_(pool)
        self.indptr.copy_(i32(b["kv_indptr"]))
        self.indices.zero_()
        self.indices[:len(b["kv_indices"])].copy_(i32(b["kv_indices"]))
        self.lens.copy_(i32(b["kv_lens"]))
        mask = pack_mask(b["tree_mask"]) if self.bits else b["tree_mask"]
        self.mask.copy_(torch.from_numpy(np.ascontiguousarray(mask, dtype=np.uint8)))

    def call(self, op):
        return op.attend(self.q, self.pool, self.indptr, self.indices, self.lens, self.mask,
                         self.o, self.lse)


def compare(name, buf, b, o=None):
    """Checks ``o`` (else buf.o, and buf.lse) against the oracle of bundle ``b``."""
    want_o, want_lse = oracle(b)
    o = buf.o if o is None else o
    got = from_bf16(o.view(torch.int16).cpu().numpy().view(np.uint16)).astype(np.float64)
    err = rel_l2(got, want_o)
    ok = err < 1e-2 and np.isfinite(got).all()
    what = f"{name}: o rel-L2 to the oracle {err:.2e}"
    if buf.lse is not None and o is buf.o:
        lse_err = float(np.abs(buf.lse.cpu().numpy() - want_lse).max())
        ok = ok and lse_err < 2e-3
        what += f", lse max abs error {lse_err:.1e}"
    check(ok, what)


SHAPES = [  # batch, draft, heads, page_size, prefixes, mask bits, lse
    (4, 8, 16, 64, [500, 1000, 4033, 77], False, True),
    (2, 16, 8, 1, [300, 17], True, False),
    (3, 1, 16, 16, [0, 5, 100], False, True),
    (5, 7, 2, 16, [63, 64, 65, 129, 16065], True, True),
]


def make_op(batch, draft, heads, page_size, pool_pages, max_indices, max_kv_len, bits, lse,
            checks="separate", **kv):
    """The op, its checks where ``checks`` says: "separate", the check kernels around the
    kernel, or "kernel", inside it (the library reads VERIFYD_OP_CHECKS when an op is made);
    None leaves the variable unset (the default)."""
    os.environ.pop("VERIFYD_OP_CHECKS", None)
    if checks is not None:
        os.environ["VERIFYD_OP_CHECKS"] = checks
    try:
        return VerifyKernel(batch, draft, heads, page_size, pool_pages, max_indices, max_kv_len,
                            sm_scale=SM_SCALE, mask_format="bits" if bits else "bytes",
                            want_lse=lse, **kv)
    finally:
        os.environ.pop("VERIFYD_OP_CHECKS", None)


def test_checks_setting():
    """An unknown VERIFYD_OP_CHECKS is refused when the op is made, naming it; unset, the checks
    run inside the kernel on sm_90 (v5t makes them) and in the op's own kernels elsewhere."""
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    for checks, want in ((None, "kernel" if sm90 else "separate"),
                         ("kernel", "kernel" if sm90 else "separate"), ("separate", "separate")):
        op = make_op(1, 4, 2, 16, 8, 8, 64, False, False, checks)
        check(op.checks == want, f"VERIFYD_OP_CHECKS={checks}: the checks run {op.checks}, "
                                 f"expected {want}")
        op.close()
    try:
        make_op(1, 4, 2, 16, 8, 8, 64, False, False, "fast")
        check(False, "VERIFYD_OP_CHECKS=fast is refused")
    except InvalidBundleError as e:
        check("VERIFYD_OP_CHECKS" in str(e), f"VERIFYD_OP_CHECKS=fast is refused: {e}")


def e4m3_bundle(b, kv_scale):
    """``b`` with its pool as e4m3 codes of its values over ``kv_scale`` (NaN slots stay NaN)."""
    e = dict(b)
    e["kv_pool"] = to_e4m3(from_bf16(b["kv_pool"]) / kv_scale)
    e["kv_scale"] = kv_scale
    return e


def test_eager_and_graph(seed, checks, kv_scale=None, shapes=SHAPES):
    """Each shape eager, then one call captured and replayed with new data; ``kv_scale``: the
    pools as e4m3 codes at that scale (v3e)."""
    def pool_of(b):
        return b if kv_scale is None else e4m3_bundle(b, kv_scale)

    kv = {} if kv_scale is None else {"kv_dtype": "e4m3", "kv_scale": kv_scale}
    for i, (batch, draft, heads, ps, prefixes, bits, lse) in enumerate(shapes):
        rng = np.random.default_rng(seed + i)
        b = pool_of(random_bundle(rng, batch, draft, heads, ps, prefixes, unused_pages=5))
        max_kv_len = max(prefixes) + draft + 50
        pool_pages = b["kv_pool"].shape[0] + 64
        max_indices = len(b["kv_indices"]) + 64
        buf = Buffers(batch, draft, heads, ps, pool_pages, max_indices, bits, lse)
        if kv_scale is not None:
            buf.pool = torch.zeros(pool_pages, ps, 576, dtype=torch.uint8, device="cuda")
        op = make_op(batch, draft, heads, ps, pool_pages, max_indices, max_kv_len, bits, lse,
                     checks, **kv)
        buf.load(b)
        failed = buf.call(op)
        torch.cuda.synchronize()
        pool = "bf16" if kv_scale is None else f"e4m3 x {kv_scale}"
        name = (f"checks {checks}, {pool}, B={batch} T={draft} H={heads} page {ps} "
                f"prefixes {prefixes}")
        check(not bool(failed.item()), f"{name}: eager call passes its checks")
        compare(f"{name}: eager", buf, b)

        # One call captured; every replay reads new data from the same buffers.
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            buf.call(op)  # warm-up on the capture stream
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            buf.call(op)
        for r in range(4):
            new = [int(p) for p in rng.integers(0, max(prefixes) + 50, size=batch)]
            nb = pool_of(random_bundle(rng, batch, draft, heads, ps, new, unused_pages=3))
            if nb["kv_pool"].shape[0] > pool_pages or len(nb["kv_indices"]) > max_indices:
                continue
            buf.load(nb)
            graph.replay()
            torch.cuda.synchronize()
            check(not bool(op.failed.item()), f"{name}: replay {r} (prefixes {new}) passes")
            compare(f"{name}: replay {r}", buf, nb)
        if kv_scale is not None:
            buf.load(b)
            buf.indices[1] = pool_pages
            graph.replay()
            torch.cuda.synchronize()
            check(bool(op.failed.item()), f"{name}: a page id past the pool fails the call")
        op.close()


def test_e4m3(seed, kv_scale=0.37):
    """An e4m3 pool through the kernel that reads its codes (v3e), eager and replayed, against the
    oracle of the pool's values; a bad page fails the call; a bad scale is refused."""
    test_eager_and_graph(seed, "separate", kv_scale, SHAPES[:2] + SHAPES[3:])
    try:
        make_op(1, 4, 2, 16, 8, 8, 64, False, False, kv_dtype="e4m3", kv_scale=0.0)
        check(False, "an e4m3 op with kv_scale 0 is refused")
    except InvalidBundleError as e:
        check("kv_scale" in str(e), f"an e4m3 op with kv_scale 0 is refused: {e}")


def test_bad_calls(seed, bits, separate_checks):
    """Each bad input, eager and replayed, with the checks inside the kernel or in kernels of
    their own (the default): `failed`, and the next good call passes. The separate checks run
    before the kernel, so o is left as it was; inside the kernel, CTAs of sound requests may
    have written theirs."""
    batch, draft, heads, ps, prefixes = 4, 7, 16, 16, [100, 37, 260, 9]
    rng = np.random.default_rng(seed)
    b = random_bundle(rng, batch, draft, heads, ps, prefixes)
    max_kv_len = 400
    pool_pages, max_indices = b["kv_pool"].shape[0], len(b["kv_indices"]) + 8
    buf = Buffers(batch, draft, heads, ps, pool_pages, max_indices, bits, True)
    op = make_op(batch, draft, heads, ps, pool_pages, max_indices, max_kv_len, bits, True,
                 "separate" if separate_checks else "kernel")
    where = ("bits" if bits else "bytes") + (", separate checks" if separate_checks else
                                              ", checks in the kernel")
    graph = torch.cuda.CUDAGraph()
    buf.load(b)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        buf.call(op)
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        buf.call(op)

    def spoil_page(bu):
        bu.indices[3] = pool_pages

    def spoil_len(bu):
        bu.lens[2] = max_kv_len + 1

    def spoil_indptr(bu):
        bu.indptr[2] = bu.indptr[1] - 1

    def spoil_mask(bu):
        if bits:
            bu.mask[1, 3, 0] |= 0x80  # bit 7: past T = 7
        else:
            bu.mask[1, 3, 0] = 2

    def spoil_late_page(bu):  # a page id past the pool in the last request's last page
        bu.indices[int(bu.indptr[batch].item()) - 1] = pool_pages + 5

    def spoil_q(bu):
        bu.q[5, 3, 7] = float("nan")

    for replay in (False, True):
        how = "replayed" if replay else "eager"
        for name, spoil, writes in (("a page id past the pool", spoil_page, False),
                                    ("the last page id past the pool", spoil_late_page, False),
                                    ("a kv_len past max_kv_len", spoil_len, False),
                                    ("a falling kv_indptr", spoil_indptr, False),
                                    ("a mask bit past T" if bits else "a mask byte of 2",
                                     spoil_mask, False),
                                    ("a NaN in q", spoil_q, True)):
            buf.load(b)
            spoil(buf)
            buf.o.fill_(1.5)
            if replay:
                graph.replay()
            else:
                buf.call(op)
            torch.cuda.synchronize()
            check(bool(op.failed.item()), f"{where}, {how}, {name}: failed")
            if not writes and separate_checks:
                check(bool((buf.o == 1.5).all().item()),
                      f"{where}, {how}, {name}: o left as it was")
            buf.load(b)
            if replay:
                graph.replay()
            else:
                buf.call(op)
            torch.cuda.synchronize()
            check(not bool(op.failed.item()),
                  f"{where}, {how}, {name}: the next good call passes")
            compare(f"{where}, {how}, after {name}", buf, b)
    op.close()


def stack_attention(buf, batch, draft, heads, page_size, max_kv_len, out, ran, layer):
    """The stack's own attention for the switch's tests: fp32 torch over static shapes
    (capturable), reading the same buffers as the op; writes ``out`` and sets ``ran[layer]``."""
    dev = buf.q.device
    t = torch.arange(max_kv_len, device=dev)

    def fn():
        lens = buf.lens.long()
        slot = (buf.indptr[:-1].long()[:, None] + t[None, :] // page_size)
        slot = slot.clamp(max=buf.indices.numel() - 1)
        pages = buf.indices[slot].long().clamp(0, buf.pool.shape[0] - 1)
        valid = t[None, :] < lens[:, None]
        kv = buf.pool[pages, t[None, :] % page_size].float()
        kv = torch.where(valid[..., None], kv, torch.zeros((), device=dev))
        q = buf.q.view(batch, draft, heads, 576).float()
        s = torch.einsum("bthd,bld->bhtl", q, kv) * SM_SCALE
        prefix = (lens - draft)[:, None]
        j = (t[None, :] - prefix).clamp(0, draft - 1)
        seen = torch.gather(buf.mask.bool(), 2, j[:, None, :].expand(batch, draft, max_kv_len))
        in_draft = (t[None, :] >= prefix) & valid
        allow = (t[None, :] < prefix)[:, None, :] | (in_draft[:, None, :] & seen)
        s = s.masked_fill(~allow[:, None], float("-inf"))
        o = torch.einsum("bhtl,bld->bthd", s.softmax(-1), kv[..., :512])
        out.copy_(o.reshape(batch * draft, heads, 512).to(torch.bfloat16))
        ran[layer].fill_(True)
    return fn


SWITCH_KINDS = {"layer": "a conditional node a layer", "step": "a conditional node a step",
                "step_redo": "a conditional node a step, a failed step redone by the stack",
                "branch": "kernel-side branch"}


def test_switch(seed, kind, checks="kernel"):
    how = f"{SWITCH_KINDS[kind]}, checks {checks}"
    conditional = kind != "branch"
    batch, draft, heads, ps, prefixes, layers = 4, 8, 16, 16, [100, 37, 260, 9], 4
    rng = np.random.default_rng(seed)
    b = random_bundle(rng, batch, draft, heads, ps, prefixes)
    max_kv_len = 400
    pool_pages, max_indices = b["kv_pool"].shape[0], len(b["kv_indices"]) + 8
    buf = Buffers(batch, draft, heads, ps, pool_pages, max_indices, False, False)
    buf.load(b)
    op = make_op(batch, draft, heads, ps, pool_pages, max_indices, max_kv_len, False, False,
                 checks)
    sw = Switch(layers, conditional=conditional)
    outs = [torch.zeros_like(buf.o) for _ in range(layers)]
    ran = torch.zeros(layers, dtype=torch.bool, device="cuda")
    fns = [stack_attention(buf, batch, draft, heads, ps, max_kv_len, outs[i], ran, i)
           for i in range(layers)]
    args = (op, buf.q, buf.pool, buf.indptr, buf.indices, buf.lens, buf.mask)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sw.begin_step()
        for i in range(layers):
            sw.attend(i, fns[i], *args, outs[i])  # eager: the kernel-side branch
    stream.synchronize()
    def forward():
        for i in range(layers):
            sw.attend(i, fns[i], *args, outs[i])

    with torch.cuda.graph(graph, stream=stream):
        if kind in ("step", "step_redo"):
            sw.step(forward, redo=kind == "step_redo")
        else:
            sw.begin_step()
            forward()

    def served_by_stack():
        return [bool(x) for x in sw.layer_failed.cpu().tolist()]

    def step(stack, what, check_outputs=True):
        ran.zero_()
        for o in outs:
            o.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        served = served_by_stack()
        ok = served == [stack] * layers
        if conditional:  # the stack's attention runs only where it serves
            ok = ok and ran.cpu().tolist() == served
        check(ok, f"switch ({how}), {what}: every layer served by the "
                  f"{'stack' if stack else 'op'} (stack served: {served}, "
                  f"ran: {ran.cpu().tolist()})")
        if check_outputs:
            for i in (0, layers - 1):
                compare(f"switch ({how}), {what}, layer {i}", buf, b, outs[i])

    sw.set_mode("stack")
    step(True, "mode stack")
    sw.set_mode("op")
    step(False, "mode op (the next replay)")
    sw.set_mode("stack")
    step(True, "rolled back: the next replay")
    sw.set_mode("op")
    buf.mask[1, 3, 3] = 2  # fails the op's mask check; the stack reads it as 1
    step(True, "the op's call failed its check")
    buf.load(b)
    step(False, "the next good step")
    # A NaN in q: the op computes, its output is not finite, and the stack's serves (the
    # stack's output is NaN there too, so only who served is checked).
    buf.q[5, 3, 7] = float("nan")
    step(True, "the op's output not finite", check_outputs=False)
    buf.load(b)
    step(False, "the step after")

    sw.set_mode("canary", 0.3)
    before = sw.counters()
    mixed = 0
    for _ in range(300):
        graph.replay()
        torch.cuda.synchronize()
        n = sum(served_by_stack())
        mixed += 0 < n < layers
    after = sw.counters()
    steps = after["steps"] - before["steps"]
    share = (after["op_steps"] - before["op_steps"]) / max(steps, 1)
    check(steps == 300 and 0.2 < share < 0.4 and mixed == 0,
          f"switch ({how}), canary 0.3: {steps} steps, {share:.2f} served by the op, "
          f"{mixed} steps mixed")

    # The lease: the op serves while renewals come; once they stop, the stack from the first
    # step past the period.
    import time  # noqa: PLC0415
    period = 0.05
    sw.set_mode("op")
    sw.renew(period)
    step(False, "lease held")
    expired_before = sw.counters()["lease_expired"]
    t0 = time.monotonic()
    fallback_s = None
    while time.monotonic() - t0 < 10 * period:
        graph.replay()
        torch.cuda.synchronize()
        if served_by_stack()[0]:
            fallback_s = time.monotonic() - t0
            break
        time.sleep(0.002)
    check(fallback_s is not None and fallback_s <= 2 * period,
          f"switch ({how}), lease of {period * 1000:.0f} ms not renewed: the stack serves after "
          f"{(fallback_s or -1) * 1000:.1f} ms")
    check(sw.counters()["lease_expired"] > expired_before,
          f"switch ({how}): expired steps counted")
    sw.renew(period)
    step(False, "lease renewed")
    sw.renew(0)
    sw.close()
    op.close()
    return {"lease_period_ms": period * 1000,
            "lease_fallback_ms": round((fallback_s or -1) * 1000, 2),
            "canary_share": round(share, 3)}


def timed_per_layer(graph, layers, replays, samples=False):
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / layers)
    return times if samples else statistics.median(times)


def bench_step(seed, layers=61, replays=30):
    """Per layer of a captured step of ``layers`` layers: the op called directly, the stack's
    stand-in alone (one fill kernel), and each switch (conditional nodes, kernel-side branch)
    in mode op and in mode stack, all over the same buffers in one process."""
    rows = []
    for batch, draft, heads, prefix in ((1, 16, 16, 4096), (8, 16, 16, 4096), (32, 8, 16, 2048),
                                        (64, 4, 16, 8192)):
        ps = 64
        rng = np.random.default_rng(seed)
        b = random_bundle(rng, batch, draft, heads, ps, [prefix] * batch)
        pool_pages, max_indices = b["kv_pool"].shape[0], len(b["kv_indices"])
        buf = Buffers(batch, draft, heads, ps, pool_pages, max_indices, False, False)
        buf.load(b)
        # The op with its checks inside the kernel, and with check kernels around it.
        op = make_op(batch, draft, heads, ps, pool_pages, max_indices, prefix + draft, False,
                     False, "kernel")
        op_sep = make_op(batch, draft, heads, ps, pool_pages, max_indices, prefix + draft, False,
                         False, "separate")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            buf.call(op)
            buf.call(op_sep)
        stream.synchronize()

        def capture(body):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                body()
            return g

        def direct(the_op):
            def body():
                for _ in range(layers):
                    buf.call(the_op)
            return body

        def stack_only():
            for _ in range(layers):
                buf.o.fill_(0.5)

        # The op called directly, checks in the kernel and checks around it, alternating over
        # two rounds in one process; their kernels' device time from CUPTI.
        graphs = {"kernel": capture(direct(op)), "separate": capture(direct(op_sep))}
        samples = {v: [] for v in graphs}
        for _ in range(2):
            for v, g in graphs.items():
                samples[v] += timed_per_layer(g, layers, replays, samples=True)
        step = {v: statistics.median(t) for v, t in samples.items()}
        k = {v: cuda_timing.device_us(g.replay, layers) for v, g in graphs.items()}
        step_us = step["kernel"]
        bare = k["separate"]["custom"]  # the kernel without checks of its own
        row = {"shape": f"{batch},{draft},{heads},{prefix}", "page_size": ps, "layers": layers,
               "layer_us_direct": round(step_us, 2),
               "layer_us_direct_separate_checks": round(step["separate"], 2),
               "custom_kernel_us": round(k["kernel"]["custom"], 2),
               "custom_kernel_us_separate_checks": round(bare, 2),
               "in_kernel_checks_us": round(k["kernel"]["custom"] - bare, 2),
               "checks_us": round(k["separate"]["checks"], 2),
               "checks_us_in_kernel_variant": round(k["kernel"]["checks"], 2),
               # A layer of the op called directly over the kernel's own device time (the
               # kernel as it runs without checks of its own, the separate variant's).
               "per_call_overhead_us": round(step_us - bare, 2),
               "per_call_overhead_us_separate_checks": round(step["separate"] - bare, 2)}
        args = (op, buf.q, buf.pool, buf.indptr, buf.indices, buf.lens, buf.mask)
        # Every kind's graph, then two rounds over all of them (mode op and mode stack, beside
        # the op and the stand-in called directly again), so that each figure has a spread.
        switches, sgraphs = {}, {}
        for name in SWITCH_KINDS:
            sw = Switch(layers, conditional=name != "branch")

            def switched(sw=sw, name=name):
                def forward():
                    for i in range(layers):
                        sw.attend(i, lambda: buf.o.fill_(0.5), *args, buf.o)
                if name in ("step", "step_redo"):
                    sw.step(forward, redo=name == "step_redo")
                else:
                    sw.begin_step()
                    forward()

            switches[name] = sw
            sgraphs[name] = capture(switched)
        stack_graph = capture(stack_only)
        rounds = {key: [] for key in ["direct", "stand_in"] + [f"{n}_{m}" for n in SWITCH_KINDS
                                                              for m in ("op", "stack")]}
        served_op = {name: True for name in SWITCH_KINDS}
        for _ in range(2):
            rounds["direct"].append(timed_per_layer(graphs["kernel"], layers, replays))
            rounds["stand_in"].append(timed_per_layer(stack_graph, layers, replays))
            for name, sw in switches.items():
                sw.set_mode("op")
                rounds[f"{name}_op"].append(timed_per_layer(sgraphs[name], layers, replays))
                served_op[name] &= not bool(sw.layer_failed.any().item())
                sw.set_mode("stack")
                rounds[f"{name}_stack"].append(timed_per_layer(sgraphs[name], layers, replays))
        row["rounds_us"] = {key: [round(v, 2) for v in vals] for key, vals in rounds.items()}
        # Each switch over the path it serves called directly in the same rounds.
        direct_us = statistics.median(rounds["direct"])
        stack_us = statistics.median(rounds["stand_in"])
        row["layer_us_stack_standin"] = round(stack_us, 2)
        for name in SWITCH_KINDS:
            op_us = statistics.median(rounds[f"{name}_op"])
            st_us = statistics.median(rounds[f"{name}_stack"])
            row[f"{name}_layer_us_mode_op"] = round(op_us, 2)
            row[f"{name}_layer_us_mode_stack"] = round(st_us, 2)
            # What the switch adds to a layer over calling the served path directly.
            row[f"{name}_switch_cost_us_mode_op"] = round(op_us - direct_us, 2)
            row[f"{name}_switch_cost_us_mode_stack"] = round(st_us - stack_us, 2)
            check(served_op[name], f"bench {row['shape']}, {name}: mode op served every layer")
        del sgraphs, stack_graph
        for sw in switches.values():
            sw.close()
        row["failed"] = bool(op.failed.item()) or bool(op_sep.failed.item())
        rows.append(row)
        print("bench", json.dumps(row))
        check(not row["failed"], f"bench {row['shape']}: every call passes its checks")
        op.close()
        op_sep.close()
    return rows


def markdown(info, switch, rows, commit):
    """The run as bench/results keeps it."""
    kinds = list(SWITCH_KINDS)
    out = [f"# The switch inside the serving process: its cost in a captured step, by kind",
           "",
           f"`tests/python/gpu_kernel_op_test.py` at `{commit}` on {info['device']} "
           f"(torch {info['torch']}), one run. A captured step of 61 layers, replayed 30 times; "
           "µs per layer, medians. The stack's attention is a stand-in (one fill kernel of o), "
           "so that what the switch adds shows; the op is the shipped kernel with its device "
           "checks, made inside the kernel (the default; the switches use it) or in "
           "kernels of their own around it (separate), the two alternating over two rounds; "
           "each kind of switch, in mode op and mode stack, then timed in two rounds over all "
           "kinds (the median of the two; each round's in the JSON's `rounds_us`, beside the op "
           "and the stand-in called directly in the same rounds). "
           "kernel: the custom kernel's device time (CUPTI spans, overlaps counted once) without "
           "checks of its own; overhead: "
           "a layer of the op called directly over that. Kinds: " + "; ".join(f"`{k}`: {v}" for k, v in SWITCH_KINDS.items()) + ".",
           "",
           "| B,T,H,prefix | op direct | op direct, separate checks | kernel | kernel with "
           "its checks | overhead | overhead, separate checks | stand-in direct | "
           + " | ".join(f"{k}: mode op (+ over direct) | {k}: mode stack (+ over direct)"
                        for k in kinds) + " |",
           "|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(kinds)]
    for r in rows:
        cells = [r["shape"], f"{r['layer_us_direct']:.2f}",
                 f"{r['layer_us_direct_separate_checks']:.2f}",
                 f"{r['custom_kernel_us_separate_checks']:.2f}", f"{r['custom_kernel_us']:.2f}",
                 f"{r['per_call_overhead_us']:.2f}",
                 f"{r['per_call_overhead_us_separate_checks']:.2f}",
                 f"{r['layer_us_stack_standin']:.2f}"]
        for k in kinds:
            cells.append(f"{r[k + '_layer_us_mode_op']:.2f} "
                         f"(+{r[k + '_switch_cost_us_mode_op']:.2f})")
            cells.append(f"{r[k + '_layer_us_mode_stack']:.2f} "
                         f"(+{r[k + '_switch_cost_us_mode_stack']:.2f})")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Correctness in the same run (every check passed unless listed below): "
            "every switch kind served the path its mode asked for at the next replay, a call "
            "failing its checks or with a non-finite output was served by the stack, every "
            "served output matched the fp64 oracle; canary 0.3 and the lease:",
            ""]
    for k, v in switch.items():
        out.append(f"- `{k}`: canary share {v.get('canary_share')}, a lease of "
                   f"{v.get('lease_period_ms')} ms not renewed fell back after "
                   f"{v.get('lease_fallback_ms')} ms")
    if failures:
        out += ["", "Failed checks:", ""] + [f"- {f}" for f in failures]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--seed", type=int, default=340)
    ap.add_argument("--md", help="also write the table (bench/results) here")
    ap.add_argument("--commit", default="unknown", help="the commit the run is of (--md)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SETUP FAILED: torch sees no CUDA device")
        return 2
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda_driver": torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version")
            else None}
    print("setup", json.dumps(info))
    test_checks_setting()
    test_e4m3(args.seed + 50)
    for checks in ("kernel", "separate"):
        test_eager_and_graph(args.seed, checks)
    for bits in (False, True):
        for separate in (False, True):
            test_bad_calls(args.seed + 100, bits, separate)
    switch = {kind: test_switch(args.seed + 300 + 100 * i, kind)
              for i, kind in enumerate(SWITCH_KINDS)}
    for i, kind in enumerate(SWITCH_KINDS):  # the same with the check kernels around the kernel
        switch[f"{kind}, separate checks"] = test_switch(args.seed + 300 + 100 * i, kind,
                                                         "separate")
    rows = bench_step(args.seed + 200)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": info, "commit": args.commit, "switch": switch, "bench": rows,
                       "failures": failures}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(info, switch, rows, args.commit))
    print(f"{len(failures)} checks failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
