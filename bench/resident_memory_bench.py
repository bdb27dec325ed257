#!/usr/bin/env python3
"""Resident memory of the real verifyd (CPU engine) against --max_inflight_mb.

Starts verifyd (VERIFYD_BIN) with a budget, warms it, then sends bursts of large unary calls at
once (the whole pool on the wire) and reads the daemon's peak resident memory (VmHWM, reset
through /proc/PID/clear_refs) against its resident memory before the burst; prints one line per
round and a JSON summary. Run from the checkout with VERIFYD_CLIENT_GEN set:

    VERIFYD_BIN=build/src/main/verifyd VERIFYD_CLIENT_GEN=build/clients/python/gen \\
      python3 bench/resident_memory_bench.py [--budget-mb 160] [--call-mb 48] [--calls 6]
"""

import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "python"),
                os.path.join(HERE, "..", "clients", "python")]
gen = os.environ.get("VERIFYD_CLIENT_GEN")
if gen:
    sys.path.insert(0, gen)

import numpy as np  # noqa: E402

from random_bundles import random_bundle  # noqa: E402
from verifyd_client import VerifyClient, VerifydError  # noqa: E402
from verifyd_daemon import Daemon  # noqa: E402


def status_kb(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def burst(daemon, calls, pages, seed):
    rng = np.random.default_rng(seed)
    bundles = [random_bundle(rng, 1, 4, 2, 64, [100 + 17 * i], unused_pages=pages)
               for i in range(calls)]
    go = threading.Barrier(calls)
    served, refused = [], []

    def one(b):
        with VerifyClient(daemon.data, timeout=60) as c:
            go.wait()
            try:
                c.verify(**b, compact=False)  # the whole pool goes on the wire
                served.append(1)
            except VerifydError as e:
                refused.append(e.code.name)

    threads = [threading.Thread(target=one, args=(b,)) for b in bundles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(served), len(refused)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mb", type=int, default=160)
    ap.add_argument("--call-mb", type=int, default=48)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=8101)
    args = ap.parse_args()
    d = Daemon(f"--max_inflight_mb={args.budget_mb}", "--max_inflight_peer_share=1",
               "--pinned_receive_mb=0")
    rows = []
    try:
        pages = (args.call_mb << 20) // (64 * 576 * 2)
        burst(d, 1, pages, args.seed)  # warm: the first large call grows gRPC's and malloc's pools
        time.sleep(1.5)
        for r in range(args.rounds):
            base = status_kb(d.proc.pid, "VmRSS")
            with open(f"/proc/{d.proc.pid}/clear_refs", "w") as f:
                f.write("5")
            served, refused = burst(d, args.calls, pages, args.seed + 1 + r)
            peak = (status_kb(d.proc.pid, "VmHWM") - base) / 1024
            time.sleep(1.5)
            after = (status_kb(d.proc.pid, "VmRSS") - base) / 1024
            rows.append({"round": r, "served": served, "refused": refused,
                         "peak_above_mb": round(peak, 1), "after_mb": round(after, 1)})
            print(f"round {r}: {served} served, {refused} refused; peak {peak:.0f} MiB above "
                  f"the resident memory before it (budget {args.budget_mb} MiB), "
                  f"{after:.0f} MiB 1.5 s after")
    finally:
        d.stop()
    print(json.dumps({"budget_mb": args.budget_mb, "call_mb": args.call_mb, "rounds": rows}))


if __name__ == "__main__":
    main()
