#!/usr/bin/env python3
"""What shadow taps cost a serving stack's step, and that every tap is accounted for.

A torch process captures a CUDA graph of a model step of LAYERS layers, each a stand-in GEMM
([B*T, 7168] x [7168, 2048], bf16) followed by a tap of that layer's attention call (q, the
stack's o, the KV pages, the layout) through verifyd_client's TapChannel. It replays the graph
and the same graph without the taps at sample rates 0, 1% and 100% (set through the admin API,
which verifyd passes to the tap kernel live), and reports per tap call:
  per_call_cost_us = (step - step without taps) / LAYERS,
and, at 100%, the cost of one copied call = (step at 100% - step at 0) / fills per step, against
10 us + bytes copied / 3 TB/s. Then with verifyd stopped (SIGSTOP) the step time again, and the
drops counted; then a long run of --long_calls tap calls at 100%, after which every tap must be
compared, refused or dropped (taps = compared + refused + dropped). --cost_only stops before
those two: the cost of another build of the tap kernel (--copy names its copy), timed beside the
default in the same GPU session. --kv_dtype e4m3: the pools in e4m3 (torch.float8_e4m3fn at
kv_scale 0.37), whose pages the tap copies at one byte an element.

    VERIFYD_CLIENT_GEN=... VERIFYD_TAP_LIB=... python3 bench/tap_bench.py --data unix://... \\
        --admin unix://... --verifyd_pid PID --out rows.json
Appends one JSON row per measurement to --out, each with the copy it measured.
"""

import argparse
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.normpath(os.path.join(HERE, "..", "clients", "python")), HERE]

import torch  # noqa: E402

from stack_bench import PAGE, SCALE, make_inputs, median_ms  # noqa: E402
from verifyd_client import AdminClient, VerifyClient  # noqa: E402

SHAPES = [(8, 16, 16, 4096), (32, 8, 16, 2048)]
HBM_BYTES_PER_S = 3e12  # the target's copy rate
KV_SCALE = 0.37  # the e4m3 pools' scale


def wait_drained(tap, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        c = tap.counts()
        if c["consumed"] == c["produced"]:
            return c
        time.sleep(0.01)
    return tap.counts()


class Step:
    """One shape's captured step, with and without taps."""

    def __init__(self, args, client, shape, device):
        b, t, h, _ = shape
        gen = torch.Generator(device=device)
        gen.manual_seed(11)
        self.pool, self.lens, self.indptr, self.indices, self.mask, self.q, self.o = make_inputs(
            shape, device, gen)
        self.kv_scale, kv_bytes = None, 2
        if args.kv_dtype == "e4m3":
            self.kv_scale, kv_bytes = KV_SCALE, 1
            self.pool = (self.pool.float() / KV_SCALE).to(torch.float8_e4m3fn)
        self.tap = client.tap_channel("bench_stack", b, t, h, int(self.indices.shape[0]), PAGE,
                                      SCALE, slots=args.slots, kv_dtype=args.kv_dtype)
        self.x = torch.randn(b * t, 7168, generator=gen, device=device).to(torch.bfloat16)
        self.w = torch.randn(7168, 2048, generator=gen, device=device).to(torch.bfloat16) * 0.01
        self.y = torch.empty(b * t, 2048, dtype=torch.bfloat16, device=device)
        self.layers = args.layers
        self.graphs = {}
        for with_taps in (True, False):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(False)  # warm-up: no tap outside the graph
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self.forward(with_taps)
            self.graphs[with_taps] = g
        b_, t_, h_ = b, t, h
        pages = int(self.indices.shape[0])
        self.bytes_per_fill = (b_ * t_ * h_ * (576 + 512) * 2 + pages * PAGE * 576 * kv_bytes)

    def forward(self, with_taps):
        for _ in range(self.layers):
            torch.matmul(self.x, self.w, out=self.y)
            if with_taps:
                self.tap.tap(self.q, self.o, self.pool, self.indptr, self.indices, self.lens,
                             self.mask, kv_scale=self.kv_scale)

    def one_tap_ms(self, reps):
        """Median stream time of one tap launched alone between two events, the ring drained
        before each (so that a sampled call finds a free slot and copies)."""
        times = []
        for _ in range(reps):
            wait_drained(self.tap)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.tap.tap(self.q, self.o, self.pool, self.indptr, self.indices, self.lens,
                         self.mask, kv_scale=self.kv_scale)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    def measure(self, reps):
        """(median step ms with taps, without, fills and drops per step with taps)."""
        for g in self.graphs.values():
            for _ in range(3):
                g.replay()
        torch.cuda.synchronize()
        c0 = self.tap.counts()
        with_ms = median_ms(self.graphs[True].replay, reps)
        c1 = self.tap.counts()
        without_ms = median_ms(self.graphs[False].replay, reps)
        fills = (c1["produced"] - c0["produced"]) / reps
        drops = (c1["dropped"] - c0["dropped"]) / reps
        return with_ms, without_ms, fills, drops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--admin", required=True)
    ap.add_argument("--verifyd_pid", type=int, required=True)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--long_calls", type=int, default=100000)
    ap.add_argument("--copy", choices=("wide", "one_load"), default="wide",
                    help="the copy of the library loaded (VERIFYD_TAP_LIB): libverifyd_tap.so "
                         "wide, libverifyd_tap_one_load.so one_load; recorded in each row")
    ap.add_argument("--cost_only", action="store_true",
                    help="the step at each rate and one tap alone only: no run with verifyd "
                         "stopped, no long run")
    ap.add_argument("--kv_dtype", choices=("bf16", "e4m3"), default="bf16",
                    help="the pools' dtype, recorded in each row")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    client = VerifyClient(args.data, transport="cuda_ipc")
    admin = AdminClient(args.admin)
    rows = []

    def record(row):
        row["copy"] = args.copy
        row["kv_dtype"] = args.kv_dtype
        rows.append(row)
        print(json.dumps(row), flush=True)

    steps = {}
    for shape in SHAPES:
        step = steps[shape] = Step(args, client, shape, device)
        at0 = None
        for rate in (0.0, 0.01, 1.0):
            admin.set_sampling("shadow", rate, f"tap bench: rate {rate}")
            time.sleep(0.3)
            wait_drained(step.tap)
            with_ms, without_ms, fills, drops = step.measure(args.reps)
            row = dict(shape=list(shape), page_size=PAGE, layers=args.layers, sample_rate=rate,
                       step_ms=with_ms, step_ms_without=without_ms,
                       per_call_cost_us=(with_ms - without_ms) * 1e3 / args.layers,
                       fills_per_step=fills, drops_per_step=drops,
                       bytes_per_fill=step.bytes_per_fill)
            if rate == 0:
                at0 = with_ms
            elif fills > drops:  # else the step's difference is mostly drops, not copies
                row["cost_per_fill_us"] = (with_ms - at0) * 1e3 / fills
                row["target_per_fill_us"] = 10 + step.bytes_per_fill / HBM_BYTES_PER_S * 1e6
            record(row)

    # One copied call against one unsampled call, each alone on the stream: the copy's cost.
    for shape, step in steps.items():
        times = {}
        for rate in (1.0, 0.0):
            admin.set_sampling("shadow", rate, f"tap bench: one tap at rate {rate}")
            time.sleep(0.3)
            step.one_tap_ms(2)  # the rate reaches the decision of the next call
            times[rate] = step.one_tap_ms(args.reps)
        row = dict(shape=list(shape), page_size=PAGE, one_tap=True,
                   copied_tap_us=times[1.0] * 1e3, unsampled_tap_us=times[0.0] * 1e3,
                   copy_us=(times[1.0] - times[0.0]) * 1e3, bytes_per_fill=step.bytes_per_fill,
                   target_per_fill_us=10 + step.bytes_per_fill / HBM_BYTES_PER_S * 1e6)
        record(row)

    accounted = args.cost_only or stopped_and_long_run(args, admin, SHAPES[0], steps[SHAPES[0]],
                                                       record)
    for s in steps.values():
        s.tap.close()
    client.close()
    with open(args.out, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0 if accounted else 1


def stopped_and_long_run(args, admin, shape, step, record):
    """The step with verifyd stopped, then the long run; whether every tap was accounted for and
    none refused."""
    # verifyd stopped: the step must not change; sampled calls are dropped and counted.
    admin.set_sampling("shadow", 1.0, "tap bench: stopped verifyd")
    time.sleep(0.3)
    wait_drained(step.tap)
    running_ms, without_ms, _, _ = step.measure(args.reps)
    os.kill(args.verifyd_pid, signal.SIGSTOP)
    try:
        d0 = step.tap.counts()["dropped"]
        stopped_ms, stopped_without_ms, fills, drops = step.measure(args.reps)
        dropped = step.tap.counts()["dropped"] - d0
    finally:
        os.kill(args.verifyd_pid, signal.SIGCONT)
    row = dict(shape=list(shape), stopped=True, sample_rate=1.0, layers=args.layers,
               step_ms_running=running_ms, step_ms_stopped=stopped_ms,
               step_ms_without=stopped_without_ms, dropped_while_stopped=dropped,
               fills_per_step_stopped=fills)
    record(row)

    # The long run: every tap accounted for.
    c0 = wait_drained(step.tap)
    g = step.graphs[True]
    replays = -(-args.long_calls // args.layers)
    t0 = time.time()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    took = time.time() - t0
    c = wait_drained(step.tap)
    totals = {k: c[k] - c0[k] for k in ("calls", "taps", "dropped", "compared", "refused")}
    totals["accounted"] = totals["taps"] == totals["compared"] + totals["refused"] + \
        totals["dropped"]
    row = dict(shape=list(shape), long_run=True, sample_rate=1.0, replays=replays,
               seconds=took, totals=totals)
    record(row)
    return totals["accounted"] and totals["refused"] == 0


if __name__ == "__main__":
    sys.exit(main())
