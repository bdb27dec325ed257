#!/usr/bin/env python3
"""The switch inside the serving process under a real verifyd's control, on a GPU: a captured
step of 4 layers (Switch.step, the op against an fp32 torch attention of the stack's), its block
a switch channel of verifyd (CPU engine: verifyd runs no kernel here, it only controls):

    VERIFYD_BIN=.../verifyd VERIFYD_CLIENT_GEN=... VERIFYD_KERNEL_LIB=.../libverifyd_kernel.so \\
        python3 tests/python/gpu_switch_verifyd_test.py [--json OUT]

- verifyd in shadow: the stack serves; `flip custom`: the op serves from the first replay after
  verifyd wrote the block (the time from the flip's answer to that is measured); a rollback: the
  stack again at the next replay after;
- verifyd SIGSTOPped while the op serves: steps keep their time (none waits for verifyd), and
  the stack serves from the first step past the lease (measured against 2x the lease); SIGCONT:
  the op again; verifyd SIGKILLed: the same fallback, for good;
- every step's served outputs checked against the fp64 oracle; the GPU's counts in `verifyctl
  status` (through AdminClient) and in the metrics.

Exit status: 0 passed, 1 a check failed, 2 the setup failed.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))
sys.path[:0] = [CLIENT, HERE]

try:
    import numpy as np
    import torch
    import gpu_kernel_op_test as t
    from random_bundles import random_bundle
    from verifyd_client import AdminClient, VerifyClient
    from verifyd_client.switch import Switch
    from verifyd_daemon import Daemon
except ImportError as e:
    print(f"SETUP FAILED: {e}")
    sys.exit(2)

LEASE_MS = 100


def run(seed):
    batch, draft, heads, ps, prefixes, layers = 4, 8, 16, 16, [100, 37, 260, 9], 4
    rng = np.random.default_rng(seed)
    b = random_bundle(rng, batch, draft, heads, ps, prefixes)
    max_kv_len = 400
    pool_pages, max_indices = b["kv_pool"].shape[0], len(b["kv_indices"]) + 8
    buf = t.Buffers(batch, draft, heads, ps, pool_pages, max_indices, False, False)
    buf.load(b)
    op = t.make_op(batch, draft, heads, ps, pool_pages, max_indices, max_kv_len, False, False)
    daemon = Daemon()
    client = VerifyClient(daemon.data, timeout=30)
    admin = AdminClient(daemon.admin)
    results = {"lease_ms": LEASE_MS}
    try:
        sw = Switch(layers, client=client, model="gpu-test", lease_ms=LEASE_MS)
        t.check(sw.block.magic != 0, "switch channel open: verifyd wrote the block")
        outs = [torch.zeros_like(buf.o) for _ in range(layers)]
        ran = torch.zeros(layers, dtype=torch.bool, device="cuda")
        fns = [t.stack_attention(buf, batch, draft, heads, ps, max_kv_len, outs[i], ran, i)
               for i in range(layers)]
        args = (op, buf.q, buf.pool, buf.indptr, buf.indices, buf.lens, buf.mask)

        def forward():
            for i in range(layers):
                sw.attend(i, fns[i], *args, outs[i])

        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            sw.begin_step()  # eager: kernel-side branches
            forward()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            sw.step(forward)

        def replay():
            """One step; which path served it (True: the stack) and its time in ms."""
            ran.zero_()
            t0 = time.monotonic()
            graph.replay()
            torch.cuda.synchronize()
            ms = (time.monotonic() - t0) * 1000
            served = [bool(x) for x in sw.layer_failed.cpu().tolist()]
            ok = served in ([True] * layers, [False] * layers) and ran.cpu().tolist() == served
            t.check(ok, f"one path a step, and the stack ran exactly where it served: {served}")
            return served[0], ms

        def served_until(stack, seconds):
            """Replays until a step is served by the stack (or the op); its time from now."""
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                if replay()[0] == stack:
                    return (time.monotonic() - t0) * 1000
            return None

        stack, _ = replay()
        t.check(stack, "verifyd in shadow: the stack serves")
        t.compare("verifyd in shadow, layer 0", buf, b, outs[0])
        admin.flip("custom", "gpu_switch_verifyd_test", force=True)
        ms = served_until(False, 2.0)
        t.check(ms is not None and ms <= LEASE_MS,
                f"flip custom: the op serves {ms} ms after the flip answered (a quarter lease is "
                f"{LEASE_MS / 4} ms)")
        results["flip_to_effect_ms"] = ms
        t.compare("verifyd in custom, layer 3", buf, b, outs[3])
        admin.rollback("gpu_switch_verifyd_test")
        ms = served_until(True, 2.0)
        t.check(ms is not None and ms <= LEASE_MS, f"rollback: the stack serves {ms} ms after")
        results["rollback_to_effect_ms"] = ms
        admin.flip("custom", "gpu_switch_verifyd_test", force=True)
        t.check(served_until(False, 2.0) is not None, "custom again")
        base = [replay()[1] for _ in range(20)]

        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            times, fallback = [], None
            while time.monotonic() - t0 < 1.0:
                stack, ms = replay()
                times.append(ms)
                if stack and fallback is None:
                    fallback = (time.monotonic() - t0) * 1000
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        t.check(fallback is not None and fallback <= 2 * LEASE_MS,
                f"verifyd stopped: the stack serves after {fallback} ms (lease {LEASE_MS} ms)")
        t.check(max(times) < 50, f"verifyd stopped: no step waited (slowest {max(times):.2f} ms,"
                                 f" median {statistics.median(times):.2f} ms, before "
                                 f"{statistics.median(base):.2f} ms)")
        t.compare("verifyd stopped, stack served, layer 0", buf, b, outs[0])
        results["sigstop_fallback_ms"] = fallback
        results["step_ms_before"] = statistics.median(base)
        results["step_ms_while_stopped_median"] = statistics.median(times)
        results["step_ms_while_stopped_max"] = max(times)
        ms = served_until(False, 2.0)
        t.check(ms is not None, f"verifyd continued: the op serves again after {ms} ms")

        def gpu_counts():
            for c in admin.status()["channels"]:
                if c.get("serving_switch"):
                    return c["serving_switch"]
            return {}

        time.sleep(LEASE_MS / 1000)
        counts = gpu_counts()
        t.check(counts.get("steps", 0) > 0 and counts.get("op_steps", 0) > 0 and
                counts.get("lease_expired", 0) > 0,
                f"status shows the GPU's counts: {counts}")
        page = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
        t.check('verifyd_switch_lease_expired_total{model="gpu-test"}' in page,
                "the metrics count the expired steps")
        results["status"] = counts

        daemon.proc.kill()
        daemon.proc.wait()
        t0 = time.monotonic()
        ms = served_until(True, 2.0)
        t.check(ms is not None and ms <= 2 * LEASE_MS,
                f"verifyd killed: the stack serves after {ms} ms")
        results["sigkill_fallback_ms"] = ms
        t.compare("verifyd killed, layer 3", buf, b, outs[3])
        stack, _ = replay()
        t.check(stack, "verifyd killed: the stack keeps serving")
        sw.close()
    finally:
        admin.close()
        client.close()
        try:
            daemon.stop()
        except Exception:  # noqa: BLE001 - killed by the test
            pass
        op.close()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--seed", type=int, default=900)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SETUP FAILED: torch sees no CUDA device")
        return 2
    results = run(a.seed)
    print("results", json.dumps(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results,
                       "failures": t.failures}, f, indent=1)
    print(f"{len(t.failures)} checks failed" if t.failures else "all checks passed")
    return 1 if t.failures else 0


if __name__ == "__main__":
    sys.exit(main())
