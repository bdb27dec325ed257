#!/usr/bin/env python3
"""Doorbell channels from a CUDA graph, against a running verifyd with the CUDA engine.

    VERIFYD_CLIENT_GEN=BUILD/clients/python/gen python3 tests/python/gpu_doorbell_test.py \\
        --data unix:///tmp/vd/verifyd.sock --admin unix:///tmp/vd/admin.sock [--replays 10000]

A torch CUDA graph captures a forward pass of LAYERS layers, each a verify call through
verifyd_client's VerifyStep (the layout set once per pass). It is replayed --replays times; before
each replay the lengths, the page table, the tree mask and q change, and after each replay q is
scribbled over. Every layer's output of every replay is checked against an fp32 torch
implementation written here (rel-L2 <= 5e-3). Then: the shadow comparisons of those calls are all
clean; a bad page id in the page table gives a zero-filled o, a counted failure and an error
naming kv_indices, and the graph goes on; two client processes at once (--clients 2) both pass;
with --verifyd, a private verifyd killed under a captured graph does not hang the next replay; with
--custom_replays, the same replays with the custom output served (checked finite as it is copied
into o) are checked against fp32 torch too; with --fp8_replays, the same replays on e4m3 pools
(torch.float8_e4m3fn, a kv_scale per layer), checked against fp32 torch of e4m3 x kv_scale, and
bad scales refused naming kv_scale.
Exit status: 0 passed, 1 a check failed, 2 the setup failed.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))
sys.path[:0] = [CLIENT, HERE]

try:
    import torch
except ImportError as e:
    print(f"SETUP FAILED: {e}")
    sys.exit(2)
from verifyd_client import AdminClient, VerifyClient, VerifydError  # noqa: E402

LAYERS, MAX_BATCH, DRAFT, HEADS, MAX_PREFIX, SLOTS = 4, 4, 8, 16, 400, 6000
SCALE = 0.1352  # a DeepSeek-like scale (YaRN), not 1/sqrt(192)
FP8_SCALES = [0.37, 1.0, 3.1, 0.0625]  # each e4m3 layer's kv_scale (k_scale)


def reference(q, pool, indptr, indices, lens, mask):
    """fp32 MLA verify attention, page size 1: q [B*T, H, 576], pool [slots, 1, 576]."""
    b_count = lens.shape[0]
    out = torch.empty(b_count * DRAFT, HEADS, 512, dtype=torch.float32, device=q.device)
    for b in range(b_count):
        n = int(lens[b])
        slots = indices[int(indptr[b]):int(indptr[b]) + n].long()
        kv = pool[slots, 0].float()  # [n, 576]
        qb = q[b * DRAFT:(b + 1) * DRAFT].float()  # [T, H, 576]
        s = torch.einsum("thd,nd->htn", qb, kv) * SCALE
        allow = torch.ones(DRAFT, n, dtype=torch.bool, device=q.device)
        allow[:, n - DRAFT:] = mask[b].bool()
        s = s.masked_fill(~allow[None], float("-inf"))
        out[b * DRAFT:(b + 1) * DRAFT] = torch.einsum("htn,nd->thd", s.softmax(-1), kv[:, :512])
    return out


def rel_l2(got, want):
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


class Pass:
    """The device inputs a forward pass reads, rewritten in place before each replay."""

    def __init__(self, gen, device, fp8=False):
        self.gen, self.device = gen, device
        values = [torch.randn(SLOTS, 1, 576, generator=gen, device=device) for _ in range(LAYERS)]
        if fp8:  # e4m3 pools; the reference reads e4m3 x kv_scale in fp32
            self.kv_scales = FP8_SCALES[:LAYERS]
            self.pools = [(v / s).to(torch.float8_e4m3fn) for v, s in zip(values, self.kv_scales)]
            self.ref_pools = [p.float() * s for p, s in zip(self.pools, self.kv_scales)]
        else:
            self.kv_scales = None
            self.pools = [v.to(torch.bfloat16) for v in values]
            self.ref_pools = self.pools
        self.indptr = torch.zeros(MAX_BATCH + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(MAX_BATCH * (MAX_PREFIX + DRAFT), dtype=torch.int32,
                                   device=device)
        self.lens = torch.zeros(MAX_BATCH, dtype=torch.int32, device=device)
        self.mask = torch.zeros(MAX_BATCH, DRAFT, DRAFT, dtype=torch.uint8, device=device)
        self.q = [torch.zeros(MAX_BATCH * DRAFT, HEADS * 576, dtype=torch.bfloat16,
                              device=device) for _ in range(LAYERS)]
        self.o = [torch.zeros(MAX_BATCH * DRAFT, HEADS * 512, dtype=torch.bfloat16,
                              device=device) for _ in range(LAYERS)]

    def rewrite(self):
        g = self.gen
        prefix = torch.randint(0, MAX_PREFIX + 1, (MAX_BATCH,), generator=g, device=self.device)
        lens = prefix + DRAFT
        self.lens.copy_(lens)
        self.indptr[1:].copy_(lens.cumsum(0))
        self.indices.copy_(torch.randint(0, SLOTS, self.indices.shape, generator=g,
                                         device=self.device))
        tri = torch.tril(torch.ones(DRAFT, DRAFT, device=self.device, dtype=torch.uint8))
        rnd = (torch.rand(MAX_BATCH, DRAFT, DRAFT, generator=g, device=self.device) < 0.5)
        self.mask.copy_(torch.maximum(tri, rnd.to(torch.uint8) * tri))  # a tree: ancestors only
        for q in self.q:
            q.copy_(torch.randn(q.shape, generator=g, device=self.device).to(torch.bfloat16))

    def scribble(self):
        for q in self.q:
            q.fill_(float("nan"))


def capture(step, p):
    def forward():
        step.set_layout(p.indptr, p.indices, p.lens, p.mask)
        for layer in range(LAYERS):
            step.attend(layer, p.q[layer], p.o[layer])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm-up, outside the graph
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph


def run_replays(args, device, seed, replays=None, label="", fp8=False):
    replays = args.replays if replays is None else replays
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    p = Pass(gen, device, fp8)
    worst, t0 = 0.0, time.monotonic()
    with VerifyClient(args.data, transport="cuda_ipc", timeout=30) as client:
        step = client.verify_step(p.pools, MAX_BATCH, DRAFT, HEADS, p.indices.shape[0], SCALE,
                                  kv_scales=p.kv_scales)
        p.rewrite()
        graph = capture(step, p)
        for i in range(replays):
            p.rewrite()
            want = [reference(p.q[layer].view(-1, HEADS, 576), p.ref_pools[layer], p.indptr,
                              p.indices, p.lens, p.mask) for layer in range(LAYERS)]
            graph.replay()
            p.scribble()  # verifyd has answered every call of the replay once the step is done
            torch.cuda.synchronize()
            for layer in range(LAYERS):
                e = rel_l2(p.o[layer].view(-1, HEADS, 512), want[layer])
                worst = max(worst, e)
                if not e <= 5e-3:
                    raise AssertionError(f"replay {i} layer {layer}: rel-L2 {e:.3g} > 5e-3")
        step.channel.check()
        # A bad page id: the graph goes on, o is zero-filled, the failure is counted and named.
        p.rewrite()
        p.indices[0] = SLOTS + 7
        graph.replay()
        torch.cuda.synchronize()
        zeros = all(int(o.view(-1, HEADS, 512)[:int(p.lens.shape[0]) * DRAFT].count_nonzero())
                    == 0 for o in p.o)
        failed = step.channel.failed_calls()
        try:
            step.channel.check()
            named = "no error raised"
        except VerifydError as e:
            named = str(e)
        if not (zeros and failed == LAYERS and "kv_indices" in named):
            raise AssertionError(f"bad page id: o zero-filled {zeros}, failed {failed} (want "
                                 f"{LAYERS}), error {named!r}")
        p.rewrite()
        graph.replay()
        torch.cuda.synchronize()
        step.channel.check()
        took = time.monotonic() - t0
        calls = (replays + 2) * LAYERS
        print(f"ok   {replays} graph replays x {LAYERS} layers{label}: every output within "
              f"rel-L2 5e-3 of fp32 torch (worst {worst:.2e}); a bad page id zero-filled o and "
              f"failed naming kv_indices; {calls} calls in {took:.1f} s", flush=True)


def check_verifyd_gone(verifyd_bin, device):
    """A private verifyd is killed while a client holds a captured graph: the next replay does
    not hang (the client's watchdog answers the rings), and check() raises UNAVAILABLE."""
    d = tempfile.mkdtemp(prefix="verifyd-gone-")
    daemon = subprocess.Popen(
        [verifyd_bin, "--engine=cuda", f"--listen=unix:{d}/verifyd.sock",
         f"--admin_listen=unix:{d}/admin.sock", "--metrics_address=127.0.0.1:0",
         f"--state_dir={d}/state", "--capture_dir=off"],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "verifyd.log"), "w"))
    for _ in range(1200):
        if os.path.exists(f"{d}/admin.sock"):
            break
        time.sleep(0.1)
    gen = torch.Generator(device=device)
    gen.manual_seed(99)
    p = Pass(gen, device)
    client = VerifyClient(f"unix://{d}/verifyd.sock", transport="cuda_ipc", timeout=10)
    step = client.verify_step(p.pools, MAX_BATCH, DRAFT, HEADS, p.indices.shape[0], SCALE)
    p.rewrite()
    graph = capture(step, p)
    graph.replay()
    torch.cuda.synchronize()
    step.channel.check()
    daemon.kill()
    daemon.wait()
    t0 = time.monotonic()
    graph.replay()
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    try:
        step.channel.check()
        raised = "nothing"
    except VerifydError as e:
        raised = f"{e.code}: {e}"
    try:
        client.close()
    except Exception:  # noqa: BLE001 - verifyd is gone: its unregister calls fail
        pass
    if not (took < 5 and step.channel.released >= 1 and "UNAVAILABLE" in raised):
        raise AssertionError(f"after verifyd was killed: a replay took {took:.2f} s, "
                             f"{step.channel.released} released, check raised {raised}")
    print(f"ok   verifyd killed under a captured graph: the next replay of {LAYERS} calls "
          f"returned in {took:.2f} s (released by the client's watchdog), check() raised "
          f"UNAVAILABLE", flush=True)


def check_fp8_refusals(args, device):
    """Bad pool scales are refused by the client before a channel opens, each naming its field."""
    from verifyd_client import InvalidBundleError  # noqa: PLC0415

    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    p = Pass(gen, device, fp8=True)
    bf16 = Pass(gen, device)
    cases = [("kv_scale", p.pools, [float("nan")] + FP8_SCALES[1:LAYERS]),
             ("kv_scale", p.pools, [0.0] + FP8_SCALES[1:LAYERS]),
             ("kv_scale", bf16.pools, [2.0] * LAYERS),  # a scale on a bf16 pool
             ("kv_scales", p.pools, FP8_SCALES[:LAYERS - 1])]
    with VerifyClient(args.data, transport="cuda_ipc", timeout=30) as client:
        for field, pools, scales in cases:
            try:
                client.verify_step(pools, MAX_BATCH, DRAFT, HEADS, p.indices.shape[0], SCALE,
                                   kv_scales=scales)
                got = "accepted"
            except InvalidBundleError as e:
                got = str(e)
            if not re.search(rf"(^|: ){field}: ", got):
                raise AssertionError(f"kv_scales {scales}: expected an error naming {field}, "
                                     f"got {got!r}")
    print(f"ok   {len(cases)} bad pool scales refused, each naming kv_scale(s)", flush=True)


def comparisons(admin_target):
    with AdminClient(admin_target) as admin:
        c = admin.status()["counters"]
    return c["comparisons_match"], c["comparisons_breach"], c["comparisons_error"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--admin", required=True)
    ap.add_argument("--replays", type=int, default=10000)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verifyd", help="a verifyd binary: also kill a private one under a graph")
    ap.add_argument("--custom_replays", type=int, default=0,
                    help="then this many replays with verifyd flipped to custom mode (the custom "
                         "output is served, checked finite as it is copied into o), then back")
    ap.add_argument("--fp8_replays", type=int, default=0,
                    help="then this many replays on e4m3 pools (a kv_scale per layer), in shadow "
                         "mode and, with --custom_replays, in custom mode")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SETUP FAILED: torch sees no CUDA device")
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    before = comparisons(args.admin)
    others = []
    for k in range(1, args.clients):  # more clients in their own processes, at the same time
        others.append(subprocess.Popen(
            [sys.executable, __file__, "--data", args.data, "--admin", args.admin,
             "--replays", str(args.replays), "--seed", str(args.seed + k)]))
    status = 0
    try:
        run_replays(args, device, args.seed)
    except Exception as e:  # noqa: BLE001
        print(f"FAIL client seed {args.seed}: {type(e).__name__}: {e}", flush=True)
        status = 1
    if args.verifyd:
        try:
            check_verifyd_gone(args.verifyd, device)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL verifyd gone: {type(e).__name__}: {e}", flush=True)
            status = 1
    for o in others:
        if o.wait() != 0:
            print(f"FAIL a second client process (rc={o.returncode})", flush=True)
            status = 1
    if args.clients > 1:
        time.sleep(2)  # the last comparisons run off the critical path
        match, breach, error = (a - b for a, b in zip(comparisons(args.admin), before))
        print(f"shadow comparisons of the doorbell calls: match {match} breach {breach} "
              f"error {error}", flush=True)
        if breach or error or not match:
            print("FAIL shadow comparisons were not all clean", flush=True)
            status = 1
        if status == 0:
            print(f"ok   {args.clients} client processes on one daemon", flush=True)
    if args.custom_replays > 0:
        with AdminClient(args.admin) as admin:
            admin.flip("custom", "doorbell graph test, custom mode", force=True)
            try:
                run_replays(args, device, args.seed + 100, args.custom_replays, " in custom mode")
            except Exception as e:  # noqa: BLE001
                print(f"FAIL custom mode: {type(e).__name__}: {e}", flush=True)
                status = 1
            finally:
                admin.flip("shadow", "doorbell graph test done", force=True)
    if args.fp8_replays > 0:
        status |= run_fp8(args, device)
    return status


def run_fp8(args, device):
    """The replays on e4m3 pools: shadow mode (whose comparisons must be clean), custom mode,
    and the refusals of bad scales."""
    status = 0
    before = comparisons(args.admin)
    try:
        run_replays(args, device, args.seed + 200, args.fp8_replays, " on e4m3 pools", fp8=True)
        time.sleep(2)  # the last comparisons run off the critical path
        match, breach, error = (a - b for a, b in zip(comparisons(args.admin), before))
        print(f"shadow comparisons of the e4m3 calls: match {match} breach {breach} error {error}",
              flush=True)
        if breach or error or not match:
            raise AssertionError("the shadow comparisons of e4m3 calls were not all clean")
        if args.custom_replays > 0:
            with AdminClient(args.admin) as admin:
                admin.flip("custom", "doorbell graph test, e4m3 in custom mode", force=True)
                try:
                    run_replays(args, device, args.seed + 300, args.fp8_replays,
                                " on e4m3 pools in custom mode", fp8=True)
                finally:
                    admin.flip("shadow", "doorbell graph test done", force=True)
        check_fp8_refusals(args, device)
    except Exception as e:  # noqa: BLE001
        print(f"FAIL e4m3 pools: {type(e).__name__}: {e}", flush=True)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
