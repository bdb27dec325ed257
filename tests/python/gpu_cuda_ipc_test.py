#!/usr/bin/env python3
"""verifyd_client's cuda_ipc transport against a running verifyd with the CUDA engine.

Starts nothing itself: it takes the daemon's addresses.

    VERIFYD_CLIENT_GEN=BUILD/clients/python/gen \\
    python3 tests/python/gpu_cuda_ipc_test.py --data unix:///run/verifyd/verifyd.sock \\
        --admin unix:///run/verifyd/admin.sock [--device 0] [--metrics http://HOST:PORT/metrics]

(or VERIFYD_DATA, VERIFYD_ADMIN, VERIFYD_METRICS_URL, VERIFYD_DEVICE in the environment).
A daemon for it, e.g.:

    verifyd --engine=cuda --listen=unix:/tmp/vd/verifyd.sock --admin_listen=unix:/tmp/vd/admin.sock \
        --metrics_address=127.0.0.1:9464 --state_dir=/tmp/vd/state --capture_dir=off

The data address must be a Unix socket (or the daemon runs with --allow_region_tcp), on the
same host, with --engine=cuda. The daemon should be in shadow mode; the shadow-hazard check
sets the shadow sample rate to 1 for its calls and restores it.

Checks, each reported PASS/FAIL with its reason:
  handle      the driver's cudaIpcMemHandle_t and allocation offset vs torch's 66-byte handle
  equal       cuda_ipc results equal the inline transport's bit for bit (fixed seeds), o on
              q's device; a registered pool, a pool registered on first use, q in a registered
              buffer, a pipelined stream
  errors      a device mismatch and an unregistered region are refused naming the field
  hazard      shadow mode: after each response q and the pool pages the call read are
              overwritten with garbage; the comparisons of those calls must show 0 breaches
  fp8         an e4m3 pool (torch.float8_e4m3fn) named in place, at scales 1 and 0.37: o within
              bf16 tolerance of the fp64 oracle of e4m3 x kv_scale, lse within 1e-3, and at
              scale 1 bit for bit the inline call with the same values as a bf16 pool
  sglang      the SGLang target-verify adapter with torch CUDA tensors vs an independent torch
              implementation, and vs the inline transport bit for bit
  cleanup     close() leaves no region of the client registered
Exit status: 0 all passed, 1 a check failed, 2 the setup failed (no torch/CUDA/daemon).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))
SCALE = 1.0 / 192.0 ** 0.5


def setup_fail(msg):
    print(f"SETUP FAILED: {msg}", flush=True)
    sys.exit(2)


def find_stubs():
    gen = os.environ.get("VERIFYD_CLIENT_GEN", "")
    if os.path.isfile(os.path.join(gen, "verifyd", "v1", "verify_pb2.py")):
        return
    if os.path.isfile(os.path.join(CLIENT, "verifyd_client", "_gen", "verifyd", "v1",
                                   "verify_pb2.py")):
        return
    gen = tempfile.mkdtemp(prefix="verifyd-py-gen-")
    r = subprocess.run([os.path.join(CLIENT, "generate.sh"), gen], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        setup_fail("no generated stubs: set VERIFYD_CLIENT_GEN to BUILD/clients/python/gen "
                   f"(generate.sh failed: {r.stderr.strip()})")
    os.environ["VERIFYD_CLIENT_GEN"] = gen


find_stubs()
sys.path[:0] = [CLIENT, HERE]
try:
    import numpy as np
    import torch
except ImportError as e:
    setup_fail(f"{e}")
from random_bundles import oracle, random_bundle, rel_l2  # noqa: E402
from sglang_reference import extend_attention_torch, random_target_verify  # noqa: E402
from verifyd_client import (AdminClient, InvalidBundleError, VerifyClient,  # noqa: E402
                            VerifydError, from_bf16, from_e4m3, sglang_target_verify, to_bf16,
                            to_e4m3)
from verifyd_client import cuda_driver  # noqa: E402

RESULTS = []


def check(name):
    def wrap(fn):
        def run(*args):
            print(f"--- {name}", flush=True)
            t0 = time.monotonic()
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - every failure is reported, the rest run
                traceback.print_exc()
                RESULTS.append((name, False, f"{type(e).__name__}: {e}"))
                print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
                return
            RESULTS.append((name, True, ""))
            print(f"PASS {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        return run
    return wrap


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def bf16_cuda(bits, device):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16) \
        .to(device)


def o_bits(o):
    return o.view(torch.int16).cpu().numpy().view(np.uint16)


def assert_same(got, want, what):
    """got: a cuda_ipc result (torch), want: an inline result (numpy)."""
    expect(got.o.is_cuda, f"{what}: o is on {got.o.device}, not the GPU")
    expect(got.o.dtype == torch.bfloat16, f"{what}: o dtype {got.o.dtype}")
    g = o_bits(got.o)
    expect(g.shape == want.o.shape, f"{what}: o shape {g.shape} != {want.o.shape}")
    diff = int((g != want.o).sum())
    expect(diff == 0, f"{what}: {diff} of {g.size} o elements differ from inline")
    if want.lse is not None:
        expect(got.lse is not None and got.lse.is_cuda, f"{what}: lse missing or not on GPU")
        lse = got.lse.cpu().numpy()
        expect(np.array_equal(lse, want.lse, equal_nan=True), f"{what}: lse differs from inline")


SHAPES = [dict(batch=1, draft=1, heads=1, page_size=1, prefixes=[0]),
          dict(batch=2, draft=5, heads=16, page_size=16, prefixes=[37, 0]),
          dict(batch=3, draft=17, heads=8, page_size=64, prefixes=[97, 1, 540], unused_pages=9,
               spare_pages=1, share_first_page=True),
          dict(batch=4, draft=8, heads=128, page_size=1, prefixes=[1000, 7, 300, 54],
               unused_pages=500)]


def torch_bundle(b, device):
    return dict(b, q=bf16_cuda(b["q"], device), kv_pool=bf16_cuda(b["kv_pool"], device),
                kv_indptr=torch.from_numpy(b["kv_indptr"]).to(device),
                kv_indices=torch.from_numpy(b["kv_indices"]).to(device),
                kv_lens=torch.from_numpy(b["kv_lens"]).to(device),
                tree_mask=torch.from_numpy(b["tree_mask"]).to(device))


@check("handle")
def check_handle(device):
    t = torch.empty(3 << 20, dtype=torch.uint8, device=device)[4096:]
    base, size, dev = cuda_driver.allocation(t.data_ptr())
    expect(dev == device.index, f"allocation device {dev} != {device}")
    expect(base <= t.data_ptr() < base + size, "the tensor lies outside its allocation")
    handle = cuda_driver.ipc_handle(base)
    expect(len(handle) == 64, f"handle is {len(handle)} bytes")
    print(f"  allocation base {base:#x} size {size}, tensor at +{t.data_ptr() - base}")
    share = t.untyped_storage()._share_cuda_()  # on a throwaway tensor: it marks it shared
    th, offset = share[1], share[3]
    print(f"  torch handle: {len(th)} bytes, version {th[0]}, type {chr(th[1])!r}, "
          f"storage offset {offset}")
    expect(offset == t.untyped_storage().data_ptr() - base,
           f"torch's storage offset {offset} != driver's {t.untyped_storage().data_ptr() - base}")
    if len(th) == 66 and th[2:] == handle:
        print("  torch's handle = version byte + type byte + the driver's 64-byte handle")
    else:
        print("  NOTE: torch's handle bytes differ from the driver's (a fresh export may differ);"
              " the calls below check that the driver's handle opens the right memory")


@check("equal")
def check_equal(args, device):
    rng = np.random.default_rng(51)
    with VerifyClient(args.data, timeout=120) as inline, \
            VerifyClient(args.data, timeout=120, transport="cuda_ipc") as c:
        for i, shape in enumerate(SHAPES):
            b = random_bundle(rng, **shape)
            tb = torch_bundle(b, device)
            for want_lse in (False, True):
                want = inline.verify(**b, want_lse=want_lse, compact=False, device=device.index)
                # The pool is registered on first use, then named in place.
                got = c.verify(**tb, want_lse=want_lse)
                assert_same(got, want, f"shape {i} want_lse={want_lse}")
                expect(got.o.device == device, f"o on {got.o.device}, q on {device}")
            pool = c.register_kv_pool(bf16_cuda(b["kv_pool"], device))
            assert_same(c.verify(**dict(tb, kv_pool=pool), want_lse=True),
                        inline.verify(**b, want_lse=True, compact=False, device=device.index),
                        f"shape {i} registered pool")
            print(f"  shape {i}: {shape} equal")
        # q in a registered buffer: named in place, no staging copy.
        b = random_bundle(rng, **SHAPES[1])
        tb = torch_bundle(b, device)
        qbuf = c.register_buffer(torch.empty(4 << 20, dtype=torch.bfloat16, device=device))
        n = tb["q"].numel()
        q_in_place = qbuf[:n].view(tb["q"].shape)
        q_in_place.copy_(tb["q"])
        assert_same(c.verify(**dict(tb, q=q_in_place)),
                    inline.verify(**b, compact=False, device=device.index), "q in place")
        # Off verifyd's 16-byte offset grid: q is staged, a pool is refused naming it.
        q_off_grid = qbuf[1:n + 1].view(tb["q"].shape)
        q_off_grid.copy_(tb["q"])
        assert_same(c.verify(**dict(tb, q=q_off_grid)),
                    inline.verify(**b, compact=False, device=device.index), "q off the grid")
        flat = torch.empty(tb["kv_pool"].numel() + 1, dtype=torch.bfloat16, device=device)
        try:
            c.register_kv_pool(flat[1:].view(tb["kv_pool"].shape))
            raise AssertionError("a pool 2 bytes into its allocation was named in place")
        except InvalidBundleError as e:
            expect(e.field == "kv_pool", f"field {e.field!r}: {e}")
        # A pipelined stream: each call in flight has its own staging slot.
        bundles = [random_bundle(rng, batch=1 + k % 3, draft=2 + k, heads=16, page_size=16,
                                 prefixes=[10 * k + 3] * (1 + k % 3)) for k in range(6)]
        wants = [inline.verify(**x, want_lse=True, compact=False, device=device.index)
                 for x in bundles]
        with c.stream() as s:
            for k, x in enumerate(bundles):
                s.send(**torch_bundle(x, device), want_lse=True, request_id=f"s{k}")
            for k in range(len(bundles)):
                r = s.recv()
                expect(r.request_id == f"s{k}", f"stream answer {r.request_id} out of order")
                assert_same(r, wants[k], f"stream call {k}")
        # The same calls through a call channel: no gRPC call per verify, o on q's device.
        with c.channel() as ch:
            for k, x in enumerate(bundles):
                r = ch.verify(**torch_bundle(x, device), want_lse=True, request_id=f"c{k}")
                expect(r.request_id == f"c{k}", f"channel answer {r.request_id}")
                expect(r.o.device == device, f"channel o on {r.o.device}, q on {device}")
                assert_same(r, wants[k], f"channel call {k}")
        regions = [r for r in c.list_regions() if r["client"] == c.client_id]
        print(f"  {len(regions)} regions registered: "
              f"{[(r['name'], r['byte_size'], r['calls']) for r in regions]}")
        expect(all(r["kind"] == "cuda_ipc" and r["device"] == device.index for r in regions),
               f"unexpected regions {regions}")


@check("fp8")
def check_fp8(args, device):
    rng = np.random.default_rng(53)
    with VerifyClient(args.data, timeout=120) as inline, \
            VerifyClient(args.data, timeout=120, transport="cuda_ipc") as c:
        for i, shape in enumerate(SHAPES[1:3]):
            for scale in (1.0, 0.37):
                b = random_bundle(rng, **shape)
                e4m3 = to_e4m3(from_bf16(b["kv_pool"]) / np.float32(scale))
                fb = dict(b, kv_pool=e4m3, kv_scale=scale)
                want_o, want_lse = oracle(fb)
                tb = dict(torch_bundle(b, device), kv_scale=scale,
                          kv_pool=torch.from_numpy(e4m3).to(device).view(torch.float8_e4m3fn))
                got = c.verify(**tb, want_lse=True)
                o = from_bf16(o_bits(got.o)).astype(np.float64)
                err = rel_l2(o, want_o)
                expect(err < 4e-3, f"shape {i} scale {scale}: rel-L2 {err:.2e} vs the oracle")
                lse_err = float(np.nanmax(np.abs(got.lse.cpu().numpy() - want_lse)))
                expect(lse_err < 1e-3, f"shape {i} scale {scale}: lse off by {lse_err:.2e}")
                if scale == 1.0:
                    as_bf16 = dict(b, kv_pool=to_bf16(from_e4m3(e4m3)))
                    assert_same(got, inline.verify(**as_bf16, want_lse=True, compact=False,
                                                   device=device.index),
                                f"shape {i} e4m3 at scale 1 vs bf16")
                print(f"  shape {i} scale {scale}: rel-L2 {err:.2e}, lse {lse_err:.1e}")


@check("errors")
def check_errors(args, device):
    rng = np.random.default_rng(52)
    b = random_bundle(rng, **SHAPES[1])
    tb = torch_bundle(b, device)
    with VerifyClient(args.data, timeout=120, transport="cuda_ipc") as c:
        try:
            c.verify(**tb, device=device.index + 1)
            raise AssertionError("a device other than q's was not refused")
        except InvalidBundleError as e:
            expect(e.field == "device", f"field {e.field!r}: {e}")
        try:
            c.verify(**dict(tb, q=tb["q"].cpu()))
            raise AssertionError("a CPU q was not refused")
        except InvalidBundleError as e:
            expect(e.field == "q", f"field {e.field!r}: {e}")
        pool = c.register_kv_pool(tb["kv_pool"])
        c.verify(**dict(tb, kv_pool=pool))
        mine = [r["name"] for r in c.list_regions() if r["client"] == c.client_id]
        c._regions.unregister(client=c.client_id)  # noqa: SLF001 - as if another process did
        try:
            c.verify(**dict(tb, kv_pool=pool))
            raise AssertionError(f"a call naming unregistered regions {mine} was served")
        except VerifydError as e:
            print(f"  {e}")
            expect(e.code.name == "NOT_FOUND", f"code {e.code}")
            expect(e.field in ("q", "kv_pool", "o_out"), f"field {e.field!r}")


def breach_counters(admin):
    c = admin.status()["counters"]
    return {k: c[k] for k in ("comparisons_match", "comparisons_breach", "comparisons_error",
                              "comparisons_skipped")}


def metric_breaches(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(r'^verifyd_comparisons_total\{[^}]*outcome="breach"[^}]*\} (\S+)$',
                         text, re.M):
        total += float(m.group(1))
    return total


@check("hazard")
def check_hazard(args, device):
    calls = 12
    with AdminClient(args.admin) as admin:
        status = admin.status()
        expect(status["mode"] == "shadow", f"the daemon is in {status['mode']} mode, not shadow")
        rate = status["shadow_sample_rate"]
        admin.set_sampling("shadow", 1.0, "gpu test: compare every call", who="gpu_cuda_ipc_test")
        try:
            before = breach_counters(admin)
            metrics_before = metric_breaches(args.metrics) if args.metrics else None
            rng = np.random.default_rng(53)
            shape = dict(batch=4, draft=16, heads=128, page_size=16,
                         prefixes=[2000, 500, 33, 1200], unused_pages=64)
            b0 = random_bundle(rng, **shape)
            with VerifyClient(args.data, timeout=120, transport="cuda_ipc") as c:
                pool = c.register_kv_pool(bf16_cuda(b0["kv_pool"], device))
                qbuf = c.register_buffer(torch.empty(b0["q"].size, dtype=torch.bfloat16,
                                                     device=device))
                q = qbuf.view(b0["q"].shape)
                for k in range(calls):
                    b = b0 if k == 0 else random_bundle(rng, **shape)
                    pool.copy_(bf16_cuda(b["kv_pool"], device))
                    q.copy_(bf16_cuda(b["q"], device))
                    pages = torch.from_numpy(b["kv_indices"]).long().to(device)
                    r = c.verify(q, pool, b["kv_indptr"], b["kv_indices"], b["kv_lens"],
                                 b["tree_mask"], b["sm_scale"], request_id=f"hazard-{k}")
                    # Right after the answer: the inputs change under the daemon's feet.
                    q.fill_(float("nan"))
                    pool.index_fill_(0, pages, float("nan"))
                    torch.cuda.current_stream(device).synchronize()
                    expect(torch.isfinite(r.o.float()).all().item(), f"call {k}: o not finite")
            deadline = time.monotonic() + 120
            while True:
                after = breach_counters(admin)
                done = sum(after[k] - before[k] for k in after)
                if done >= calls or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            delta = {k: after[k] - before[k] for k in after}
            print(f"  comparisons of the {calls} calls: {delta}")
            expect(done >= calls, f"only {done} of {calls} comparisons finished in 120 s")
            expect(delta["comparisons_breach"] == 0,
                   f"{delta['comparisons_breach']} breaches: the custom path read inputs the "
                   f"client overwrote after the response")
            expect(delta["comparisons_error"] == 0, f"{delta['comparisons_error']} errors")
            expect(delta["comparisons_match"] >= 1, "no comparison matched")
            if metrics_before is not None:
                grown = metric_breaches(args.metrics) - metrics_before
                print(f"  /metrics breaches grew by {grown}")
                expect(grown == 0, f"/metrics shows {grown} new breaches")
        finally:
            admin.set_sampling("shadow", rate, "gpu test: sampling sweep", who="gpu_cuda_ipc_test")


@check("sglang")
def check_sglang(args, device):
    rng = np.random.default_rng(54)
    with VerifyClient(args.data, timeout=120) as inline, \
            VerifyClient(args.data, timeout=120, transport="cuda_ipc") as c:
        for batch, draft, heads, prefixes in ((1, 1, 16, [0]), (2, 5, 16, [37, 1]),
                                              (3, 17, 128, [970, 0, 54])):
            call = random_target_verify(rng, batch, draft, heads, prefixes)
            t = {"q": bf16_cuda(call["q"], device), "k_buffer": bf16_cuda(call["k_buffer"], device)}
            for k in ("kv_indptr", "kv_indices", "out_cache_loc", "mask_indptr", "qo_indptr"):
                t[k] = torch.from_numpy(call[k]).to(device)
            t["custom_mask"] = torch.from_numpy(call["custom_mask"]).to(device)
            k_buffer = c.register_kv_pool(t["k_buffer"])
            r = sglang_target_verify(c, **dict(t, k_buffer=k_buffer), sm_scale=SCALE,
                                     want_lse=True)
            want_o, want_lse = extend_attention_torch(
                t["q"], t["k_buffer"], t["kv_indptr"], t["kv_indices"], t["out_cache_loc"],
                t["custom_mask"], t["mask_indptr"], SCALE)
            expect(r.o.is_cuda and r.o.shape == (batch * draft, heads, 512),
                   f"o {tuple(r.o.shape)} on {r.o.device}")
            o = r.o.double()
            err = ((o - want_o).norm() / want_o.norm()).item()
            lse_err = (r.lse.double() - want_lse).abs().max().item()
            print(f"  B={batch} T={draft} H={heads}: rel_l2 {err:.2e}, lse max abs {lse_err:.2e}")
            expect(err < 1e-2, f"rel_l2 {err} vs the torch implementation")
            expect(lse_err < 1e-3, f"lse off by {lse_err}")
            want = sglang_target_verify(inline, **call, sm_scale=SCALE, want_lse=True,
                                        compact=False, device=device.index)
            assert_same(r, want, f"adapter B={batch} T={draft}")


@check("cleanup")
def check_cleanup(args, device):
    b = random_bundle(np.random.default_rng(55), **SHAPES[1])
    c = VerifyClient(args.data, timeout=120, transport="cuda_ipc")
    c.verify(**torch_bundle(b, device))
    mine = [r for r in c.list_regions() if r["client"] == c.client_id]
    expect(mine, "no region registered")
    with VerifyClient(args.data, timeout=30) as other:
        c.close()
        left = [r for r in other.list_regions() if r["client"] == c.client_id]
    expect(not left, f"regions left after close(): {left}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get("VERIFYD_DATA"))
    p.add_argument("--admin", default=os.environ.get("VERIFYD_ADMIN"))
    p.add_argument("--metrics", default=os.environ.get("VERIFYD_METRICS_URL"))
    p.add_argument("--device", type=int, default=int(os.environ.get("VERIFYD_DEVICE", "0")))
    args = p.parse_args()
    if not args.data or not args.admin:
        setup_fail("give --data and --admin (or VERIFYD_DATA and VERIFYD_ADMIN)")
    if not torch.cuda.is_available():
        setup_fail("torch sees no CUDA device")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}; data {args.data}, "
          f"admin {args.admin}", flush=True)
    try:
        with VerifyClient(args.data, timeout=10) as c:
            health = c.health()
        with AdminClient(args.admin) as admin:
            engine = admin.status()["engine"]
    except Exception as e:  # noqa: BLE001
        setup_fail(f"the daemon does not answer: {e}")
    print(f"daemon: {health}, engine {engine}", flush=True)
    if health != "SERVING" or engine["engine"] != "cuda":
        setup_fail(f"need a SERVING daemon with the CUDA engine (health {health}, engine "
                   f"{engine['engine']})")
    check_handle(device)
    check_equal(args, device)
    check_errors(args, device)
    check_fp8(args, device)
    check_hazard(args, device)
    check_sglang(args, device)
    check_cleanup(args, device)
    print("\n=== summary")
    for name, ok, why in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + why if why else ''}")
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
