#!/usr/bin/env python3
"""A serving stack's decode step with verifyd inside it: what a verify call costs the step.

A torch process captures a CUDA graph of a model step of LAYERS layers, each a stand-in GEMM
([B*T, 7168] x [7168, 2048], bf16) followed by a target-verify attention call through
verifyd_client's VerifyStep (a doorbell channel; the layout set once per step). It replays the
graph and the same graph without the verify calls, and reports per step the medians of both,
the served path's device time per call (the VerifyResponse's served_device_seconds, as verifyd
measured it) x LAYERS, and the per-call overhead = (step - step without - device time) / LAYERS.
Then the eager path (the same calls without a graph, each synchronised) per call, unless
--eager_calls is 0.

    VERIFYD_CLIENT_GEN=... python3 bench/stack_bench.py --data unix://... --admin unix://... \\
        --mps 0 --out rows.json
Appends one JSON row per (mode, shape, graph/eager) to --out.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.normpath(os.path.join(HERE, "..", "clients", "python"))]

import torch  # noqa: E402

from cuda_timing import median_ms  # noqa: E402
from verifyd_client import AdminClient, VerifyClient  # noqa: E402

SHAPES = [(1, 16, 16, 4096), (8, 16, 16, 4096), (32, 8, 16, 2048), (64, 4, 16, 8192)]
PAGE = 64
SCALE = 0.1352


def make_inputs(shape, device, gen):
    b, t, h, prefix = shape
    pages_per = -(-(prefix + t) // PAGE)
    pages = b * pages_per + 8
    pool = torch.randn(pages, PAGE, 576, generator=gen, device=device).to(torch.bfloat16)
    lens = torch.full((b,), prefix + t, dtype=torch.int32, device=device)
    indptr = torch.arange(0, (b + 1) * pages_per, pages_per, dtype=torch.int32, device=device)
    indices = torch.randperm(pages, generator=gen, device=device)[:b * pages_per].to(torch.int32)
    mask = torch.tril(torch.ones(b, t, t, dtype=torch.uint8, device=device))
    q = torch.randn(b * t, h * 576, generator=gen, device=device).to(torch.bfloat16)
    o = torch.zeros(b * t, h * 512, dtype=torch.bfloat16, device=device)
    return pool, lens, indptr, indices, mask, q, o


def bench_shape(args, client, shape, mode, device):
    b, t, h, prefix = shape
    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    pool, lens, indptr, indices, mask, q, o = make_inputs(shape, device, gen)
    step = client.verify_step([pool] * args.layers, b, t, h, int(indices.shape[0]), SCALE)
    x = torch.randn(b * t, 7168, generator=gen, device=device).to(torch.bfloat16)
    w = torch.randn(7168, 2048, generator=gen, device=device).to(torch.bfloat16) * 0.01
    y = torch.empty(b * t, 2048, dtype=torch.bfloat16, device=device)

    def forward(with_verify):
        if with_verify:
            step.set_layout(indptr, indices, lens, mask)
        for layer in range(args.layers):
            torch.matmul(x, w, out=y)
            if with_verify:
                step.attend(layer, q, o)

    graphs = {}
    for with_verify in (True, False):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(with_verify)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            forward(with_verify)
        graphs[with_verify] = g
    for g in graphs.values():
        for _ in range(3):
            g.replay()
    torch.cuda.synchronize()
    step_ms = median_ms(graphs[True].replay, args.reps)
    timing = step.channel.last_response().timing
    device_ms = timing.served_device_seconds * 1e3
    # Where verifyd's host spent the last call, microseconds (the Timing message's stages).
    stages = {k: round(getattr(timing, f"{k}_seconds") * 1e6, 1)
              for k in ("decode", "prepare", "served", "fetch", "total")}
    without_ms = median_ms(graphs[False].replay, args.reps)
    step.channel.check()
    rows = [dict(graph=True, mps=bool(args.mps), verifyd=args.label, mode=mode, shape=list(shape),
                 layers=args.layers,
                 step_ms=step_ms, step_ms_without=without_ms,
                 kernel_ms_per_call=device_ms, server_stages_us=stages,
                 per_call_overhead_us=(step_ms - without_ms - device_ms * args.layers) * 1e3
                 / args.layers)]
    if args.eager_calls == 0:
        step.close()
        return rows
    # The eager path: the same call, one at a time, synchronised (as a caller outside a graph).
    lat = []
    step.set_layout(indptr, indices, lens, mask)
    for i in range(args.eager_calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step.attend(i % args.layers, q, o)
        torch.cuda.synchronize()
        lat.append(time.perf_counter() - t0)
    step.channel.check()
    rows.append(dict(graph=False, mps=bool(args.mps), verifyd=args.label, mode=mode,
                     shape=list(shape),
                     eager_p50_us=statistics.median(lat) * 1e6,
                     kernel_ms_per_call=step.channel.last_response().timing
                     .served_device_seconds * 1e3))
    step.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--admin", required=True)
    ap.add_argument("--mps", type=int, default=0)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--eager_calls", type=int, default=200)
    ap.add_argument("--modes", default="shadow,custom")
    ap.add_argument("--label", default="this",
                    help="which verifyd build served the run (rows' `verifyd` field)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rows = []
    with VerifyClient(args.data, transport="cuda_ipc", timeout=60) as client, \
            AdminClient(args.admin) as admin:
        for mode in args.modes.split(","):
            admin.flip(mode, "stack benchmark", force=True)
            for shape in SHAPES:
                for r in bench_shape(args, client, shape, mode, device):
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        admin.flip("shadow", "stack benchmark done", force=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
