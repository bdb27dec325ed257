#!/usr/bin/env python3
"""Times FlashMLA's dense decode (causal, page 64, bf16) on verifyd-bench's shapes and adds its
rows (path "flashmla-dense-causal") to verifyd-bench's JSON of the same run, then prints the
custom kernel's time against FlashMLA's per shape as markdown. Each call is timed alone between
two CUDA events, as verifyd-bench times its launches; medians of --reps after a first call (which
fills FlashMLA's scheduler metadata) and warm-up outside the timing.

    python3 time_flashmla.py --so flashmla_dense.so --bench-json OUT/<date>-<commit>-<device>.json
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flashmla_peer import FlashMLADense  # noqa: E402

PATH = "flashmla-dense-causal"
PAGE = 64


def time_shape(peer, b, t, h, prefix, reps, gen):
    per = -(-(prefix + t) // PAGE)
    pages = b * per
    pool = (torch.randn(pages, PAGE, 576, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32).view(b, per)
    lens = torch.full((b,), prefix + t, dtype=torch.int32, device="cuda")
    q = torch.randn(b, t, h, 576, generator=gen, device="cuda").to(torch.bfloat16)
    call = peer.call(q, pool, table, lens, 576 ** -0.5)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e))
    ms = statistics.median(times)
    # QK over 576 dims and PV over 512, each key seen by every row (causal inside the draft).
    keys = b * h * (t * prefix + t * (t + 1) / 2)
    flops = 2 * keys * (576 + 512)
    return {"path": PATH, "B": b, "T": t, "H": h, "prefix": prefix, "page_size": PAGE, "ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--so", required=True)
    ap.add_argument("--bench-json", required=True, help="verifyd-bench's JSON; rows are added")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    peer = FlashMLADense.load(args.so)
    report = json.load(open(args.bench_json))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(37)
    shapes = list(dict.fromkeys((r["B"], r["T"], r["H"], r["prefix"]) for r in report["rows"]))
    report["rows"] = [r for r in report["rows"] if r["path"] != PATH]
    mine = []
    for b, t, h, prefix in shapes:
        try:
            row = time_shape(peer, b, t, h, prefix, args.reps, gen)
        except Exception as e:  # noqa: BLE001 - a shape FlashMLA refuses is named, not fatal
            row = {"path": PATH, "B": b, "T": t, "H": h, "prefix": prefix, "page_size": PAGE,
                   "ms": -1, "error": repr(e)}
        mine.append(row)
    report["rows"] += mine
    report["flashmla"] = open(os.path.join(os.path.dirname(args.so), "SOURCES")).read().split()
    with open(args.bench_json, "w") as f:
        json.dump(report, f, indent=2)
    bf16 = [r for r in report["rows"] if r.get("kv_dtype", "bf16") == "bf16"]  # the peer's dtype
    paths = sorted({r["path"] for r in bf16 if r.get("page_size") == PAGE
                    and r["path"] != PATH and r["path"] != "reference"})
    print("| B,T,H,prefix | FlashMLA ms | FlashMLA TFLOP/s | "
          + " | ".join(f"{p} ms | {p} / FlashMLA" for p in paths) + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(paths))
    for m in mine:
        cells = [f"{m['B']},{m['T']},{m['H']},{m['prefix']}",
                 f"{m['ms']:.4f}" if m["ms"] > 0 else m.get("error", "-"),
                 f"{m.get('tflops', 0):.0f}"]
        for p in paths:
            r = next((r for r in bf16 if r["path"] == p and r["page_size"] == PAGE and
                      (r["B"], r["T"], r["H"], r["prefix"]) ==
                      (m["B"], m["T"], m["H"], m["prefix"])), None)
            ok = r is not None and r["ms"] > 0 and m["ms"] > 0
            cells += [f"{r['ms']:.4f}" if ok else "-", f"{r['ms'] / m['ms']:.2f}" if ok else "-"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
