#!/usr/bin/env python3
"""Shadow taps from a CUDA graph, against a running verifyd with the CUDA engine.

    VERIFYD_CLIENT_GEN=... VERIFYD_TAP_LIB=.../libverifyd_tap.so python3 \\
        tests/python/gpu_tap_test.py --data unix:///tmp/vd/verifyd.sock \\
        --admin unix:///tmp/vd/admin.sock --verifyd_log /tmp/vd/verifyd.log

A torch CUDA graph captures one layer of a serving stack: its own verify attention (an fp32
torch implementation written here, page size 1) followed by a tap of that call. Before each
replay q and the page table change; on 1% of replays the stack's attention is given a mask with
one bit flipped (row 0 of request 0 sees draft token 1): a bug in the stack's kernel. At a sample
rate of 1 every replay after the first is tapped and compared; verifyd must report a
stack-vs-reference breach on exactly the planted calls (its log names each by call number), none
on the others, and custom within tolerance of the reference everywhere. Every tap ends compared.
With --kv_dtype e4m3 the pool is torch.float8_e4m3fn at kv_scale KV_SCALE (the stack reads
e4m3 x kv_scale in fp32), and the tap copies its e4m3 pages and names the scale.
Exit status: 0 passed, 1 a check failed, 2 the setup failed.
"""

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))
sys.path[:0] = [CLIENT, HERE]

try:
    import torch
except ImportError as e:
    print(f"SETUP FAILED: {e}")
    sys.exit(2)
from verifyd_client import AdminClient, VerifyClient  # noqa: E402

B, T, H, PREFIX, SLOTS = 4, 8, 16, 120, 4096
L = PREFIX + T
SCALE = 0.1352
KV_SCALE = 0.37  # the e4m3 pool's k_scale


def stack_attention(q, pool, indices, mask, out):
    """The stack's own attention, fp32, static shapes (capturable): q [B*T, H*576], pool
    [SLOTS, 1, 576], indices [B*L] (request b's tokens at b*L), mask [B, T, T]; out bf16
    [B*T, H*512]."""
    kv = pool[indices.long(), 0].float().view(B, L, 576)
    qb = q.view(B, T, H, 576).float()
    s = torch.einsum("bthd,bnd->bhtn", qb, kv) * SCALE
    allow = torch.ones(B, T, L, dtype=torch.bool, device=q.device)
    allow[:, :, PREFIX:] = mask.bool()
    s = s.masked_fill(~allow[:, None], float("-inf"))
    o = torch.einsum("bhtn,bnd->bthd", s.softmax(-1), kv[..., :512])
    out.copy_(o.reshape(B * T, H * 512).to(torch.bfloat16))


def tap_info(admin, name):
    for c in admin.status().get("channels", []):
        if c["name"] == name:
            return c.get("tap", {})
    return {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--admin", required=True)
    ap.add_argument("--verifyd_log", required=True)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--kv_dtype", choices=["bf16", "e4m3"], default="bf16")
    args = ap.parse_args()
    backend = "torch_test" if args.kv_dtype == "bf16" else "torch_test_e4m3"
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev)
    gen.manual_seed(2026)
    values = torch.randn(SLOTS, 1, 576, generator=gen, device=dev)
    if args.kv_dtype == "e4m3":
        pool, kv_scale = (values / KV_SCALE).to(torch.float8_e4m3fn), KV_SCALE
        stack_pool = pool.float() * KV_SCALE  # what the stack's attention reads
    else:
        pool, kv_scale = values.to(torch.bfloat16), None
        stack_pool = pool
    q = torch.zeros(B * T, H * 576, dtype=torch.bfloat16, device=dev)
    o = torch.zeros(B * T, H * 512, dtype=torch.bfloat16, device=dev)
    indices = torch.zeros(B * L, dtype=torch.int32, device=dev)
    indptr = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=dev)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    mask = torch.tril(torch.ones(B, T, T, dtype=torch.uint8, device=dev))
    stack_mask = mask.clone()
    planted = {r for r in range(args.replays) if r % 100 == 37}

    client = VerifyClient(args.data, transport="cuda_ipc")
    admin = AdminClient(args.admin)
    admin.set_sampling("shadow", 1.0, "tap test: every call")
    tap = client.tap_channel(backend, B, T, H, B * L, 1, SCALE, slots=8, kv_dtype=args.kv_dtype)
    time.sleep(0.3)  # the rate reaches the control block

    def layer():
        stack_attention(q, stack_pool, indices, stack_mask, o)
        tap.tap(q, o, pool, indptr, indices, lens, mask, kv_scale=kv_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stack_attention(q, stack_pool, indices, stack_mask, o)  # warm-up without a tap
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer()
    failures = []
    for r in range(args.replays):
        q.copy_((torch.randn(B * T, H * 576, generator=gen, device=dev) * 0.05).to(torch.bfloat16))
        indices.copy_(torch.randperm(SLOTS, generator=gen, device=dev)[:B * L].to(torch.int32))
        stack_mask.copy_(mask)
        if r in planted:
            stack_mask[0, 0, 1] = 1
        g.replay()
        torch.cuda.synchronize()
        deadline = time.time() + 30
        while True:  # one fill at a time: nothing is dropped
            c = tap.counts()
            if c["consumed"] == c["produced"]:
                break
            if time.time() > deadline:
                failures.append(f"replay {r}: verifyd did not take the fill within 30 s: {c}")
                break
            time.sleep(0.0005)
        if failures:
            break
    c = tap.counts()
    info = tap_info(admin, tap.name)
    print(f"counts {c}")
    print(f"status tap {info}")
    if c["calls"] != args.replays or c["taps"] != args.replays - 1:
        failures.append(f"calls {c['calls']}, taps {c['taps']}: expected {args.replays} and "
                        f"{args.replays - 1} (every call but the first sampled)")
    if c["compared"] != c["taps"] or c["dropped"] or c["refused"]:
        failures.append(f"compared {c['compared']}, dropped {c['dropped']}, refused "
                        f"{c['refused']}: every tap should be compared")
    log = open(args.verifyd_log, encoding="utf-8", errors="replace").read()
    breached = {int(m) for m in re.findall(rf"breached against the reference on tap:{backend}:"
                                           r"(\d+)", log)}
    print(f"planted {sorted(planted)}, stack breaches logged on calls {sorted(breached)}")
    if breached != planted:
        failures.append(f"stack-vs-reference breaches on calls {sorted(breached)}, planted "
                        f"{sorted(planted)}")
    if int(info.get("stack_breaches", -1)) != len(planted):
        failures.append(f"status: stack_breaches {info.get('stack_breaches')}, expected "
                        f"{len(planted)}")
    worst_cr = float(info.get("worst_custom_vs_reference", 1))
    if not worst_cr < 0.01:
        failures.append(f"worst custom vs reference rel-L2 {worst_cr}: past tolerance")
    print(f"worst rel-L2: custom/reference {worst_cr:.3g}, stack/reference "
          f"{float(info.get('worst_stack_vs_reference', 0)):.3g}, custom/stack "
          f"{float(info.get('worst_custom_vs_stack', 0)):.3g}")
    tap.close()
    client.close()
    for f in failures:
        print(f"FAIL {f}")
    print("PASS" if not failures else "FAILED")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
