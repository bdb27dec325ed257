#!/usr/bin/env python3
"""A serving process's KV pool per layer registered as one CUDA region set, and each SGLang
backend's adapter calling verifyd on several layers of it, against a running verifyd with the
CUDA engine.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True VERIFYD_CLIENT_GEN=BUILD/clients/python/gen \\
    python3 tests/python/gpu_region_set_test.py --data unix:///tmp/vd/verifyd.sock \\
        --admin unix:///tmp/vd/admin.sock [--verifyctl BIN] [--device 0]

The data address must be verifyd's Unix socket (VMM members' descriptors go to its descriptor
socket, PATH.fds). PYTORCH_CUDA_ALLOC_CONF is set to expandable_segments:True when unset.

Checks, each reported PASS/FAIL with its reason:
  register  61 layer pools (bf16 [4096, 1, 576], 4.7 MB each, allocated one after another as
            SGLang's MLATokenToKVPool does) registered in one call (client.register_cuda_set):
            the pools in expandable segments are VMM members; where torch can switch its
            allocator back, the last two are cudaMalloc memory and CUDA IPC members. Listed as
            one set of 61 members counted as 61 regions, one line in `verifyctl status`
  backends  for Triton, FlashInfer MLA and FlashMLA in turn, on layers 0, 17, 33 and 60 (and
            59, a CUDA IPC member when there are any): the backend's own arguments (seeded, from
            test_adapters.py's generators) with its pool written into that layer's pool,
            converted by verify_args(..., pool set, layer=L) and run through verifyd; every
            output within rel-L2 5e-3 of fp32 torch attention computed from the backend's
            arguments as its kernel reads them (test_adapters.py's references), at DeepSeek-V3's
            softmax scale. The calls name the pool by (set, layer): the set's call count grows
            by one a call and no region of the pool's size is registered alone
  index     a call naming member 61 of the set is refused INVALID_ARGUMENT naming kv_pool
  cleanup   unregister_set releases the 61 members; close() leaves nothing of the client
Exit status: 0 all passed, 1 a check failed, 2 the setup failed.
"""

import argparse
import os
import subprocess
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# Stubs, check/expect and the results table of the cuda_ipc test; torch is imported there, after
# the allocator setting above.
from gpu_cuda_ipc_test import RESULTS, check, expect, setup_fail  # noqa: E402

import grpc  # noqa: E402
import torch  # noqa: E402
import test_adapters as ta  # noqa: E402 - each backend's arguments and fp32 reference
from verifyd_client import AdminClient, VerifyClient, VerifydError, vmm_fds  # noqa: E402
from verifyd_client.adapters import flashinfer_mla, flashmla, run, triton  # noqa: E402

LAYERS = 61
SLOTS = 4096  # per layer pool: [4096, 1, 576] bf16, 64 pages of 64 for FlashMLA
CALL_LAYERS = (0, 17, 33, 60)


def allocate_pools(device):
    """61 pools, the last two with expandable segments off when torch can switch (CUDA IPC
    members), the rest in expandable segments (VMM members)."""
    switch = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    pools = []
    for layer in range(LAYERS):
        if layer == LAYERS - 2 and switch is not None:
            switch("expandable_segments:False")
        pools.append(torch.zeros(SLOTS, 1, 576, dtype=torch.bfloat16, device=device))
    if switch is not None:
        switch("expandable_segments:True")
    return pools


@check("register")
def check_register(args, c, pools, state):
    ps = state["set"] = c.register_cuda_set("layers", pools)
    info = ps.info
    print(f"  set '{ps.name}': {info['members']} members, {info['vmm_members']} VMM, "
          f"{info['byte_size'] / 1e6:.0f} MB on GPU {info['device']} ({info['owner']})")
    expect(info["members"] == LAYERS, f"{info['members']} members, expected {LAYERS}")
    expect(info["kind"] == "cuda_ipc", f"kind {info['kind']}")
    expect(ps.kinds.count("vmm") == info["vmm_members"],
           f"client kinds {ps.kinds} against vmm_members {info['vmm_members']}")
    expect(info["vmm_members"] >= LAYERS - 2, f"only {info['vmm_members']} VMM members: "
                                              f"expandable segments are not in effect")
    print(f"  member kinds: {ps.kinds.count('vmm')} vmm, {ps.kinds.count('cuda_ipc')} cuda_ipc")
    sets = [s for s in c.list_region_sets() if s["client"] == c.client_id]
    expect(len(sets) == 1 and sets[0]["members"] == LAYERS, f"listed sets: {sets}")
    with AdminClient(args.admin) as admin:
        st = admin.status()
    count = int(st["region_count"])
    expect(count >= LAYERS, f"region_count {count}: the members are not counted one by one")
    if args.verifyctl:
        out = subprocess.run([args.verifyctl, f"--admin={args.admin}", "status"],
                             capture_output=True, text=True, check=True).stdout
        lines = [x for x in out.splitlines() if x.startswith("region set")]
        print("  " + "\n  ".join(lines))
        expect(len(lines) == 1 and "61 members" in lines[0] and "on GPU" in lines[0],
               f"verifyctl status: {lines}")


def backend_call(backend, seed, layer, ps, device):
    """(VerifyArgs, fp32 reference) of one call of ``backend`` on ``layer``."""
    draft = 5 if seed % 2 else 7
    if backend == "triton":
        call = ta.triton_call(seed, draft, mode="qlen_packed", device=device)
        pool, name = call["k_buffer"], "k_buffer"
        want = ta.triton_reference(call, "qlen_packed", ta.SCALE)
        kw = {"sm_scale": ta.SCALE, "tree_mask_mode": "qlen_packed"}
        conv = triton.verify_args
    elif backend == "flashinfer_mla":
        call = ta.flashinfer_call(seed, draft, device)
        pool, name = call["k_buffer"], "k_buffer"
        want = ta.flashinfer_reference(call, ta.SCALE)
        kw, conv = {"sm_scale": ta.SCALE}, flashinfer_mla.verify_args
    else:
        call = ta.flashmla_call(seed, draft, device)
        pool, name = call["k_cache"], "k_cache"
        want = ta.flashmla_reference(call, ta.SCALE)
        kw, conv = {"softmax_scale": ta.SCALE}, flashmla.verify_args
    rows = pool.reshape(-1, 1, 576)
    expect(rows.shape[0] <= SLOTS, f"{backend}: {rows.shape[0]} slots do not fit a layer pool")
    ps[layer].zero_()
    ps[layer][:rows.shape[0]].copy_(rows)
    args = conv(**dict(call, **{name: ps}), layer=layer, **kw)
    expect(args.layer == layer, f"VerifyArgs.layer {args.layer}")
    expect(args.kv_pool.data_ptr() == ps[layer].data_ptr(), "kv_pool is not the layer's pool")
    return args, want


def set_calls(c):
    return next(s["calls"] for s in c.list_region_sets() if s["name"] == "layers")


@check("backends")
def check_backends(c, ps, device):
    layers = list(CALL_LAYERS)
    if "cuda_ipc" in ps.kinds:
        layers.append(ps.kinds.index("cuda_ipc"))
    seed = 500
    worst = 0.0
    for backend in ("triton", "flashinfer_mla", "flashmla"):
        for layer in layers:
            seed += 1
            before = set_calls(c)
            args, want = backend_call(backend, seed, layer, ps, device)
            r = run(c, args)
            err = ta.rel_l2(r.o.float(), want.reshape(r.o.shape))
            worst = max(worst, err)
            print(f"  {backend:<15} layer {layer:>2} ({ps.kinds[layer]:<8}) B={args.batch} "
                  f"T={args.draft}: rel-L2 {err:.2e} against fp32 torch")
            expect(err < ta.TOL, f"{backend} layer {layer}: rel-L2 {err:.2e} >= {ta.TOL}")
            after = set_calls(c)
            expect(after == before + 1, f"{backend} layer {layer}: the set's calls went "
                                        f"{before} -> {after}: the pool was not named by set")
    alone = [r for r in c.list_regions()
             if r["client"] == c.client_id and r["byte_size"] == SLOTS * 576 * 2]
    expect(not alone, f"a layer pool was registered alone as well: {alone}")
    print(f"  worst rel-L2 {worst:.2e} over {3 * len(layers)} calls")


@check("index")
def check_index(c, ps, device):
    args, _ = backend_call("flashinfer_mla", 900, 3, ps, device)
    used = int(args.kv_indptr[args.batch])
    req, pending = c._transport.encode(args.q, args.kv_pool, args.kv_indptr,
                                       args.kv_indices[:used], args.kv_lens, args.tree_mask,
                                       args.sm_scale, False, None, True, None, False,
                                       args.mask_format)
    try:
        expect(req.kv_pool.cuda_ipc.set == "layers" and req.kv_pool.cuda_ipc.index == 3,
               f"kv_pool is named as {req.kv_pool.cuda_ipc}")
        req.kv_pool.cuda_ipc.index = LAYERS
        try:
            c._stub.Verify(req, timeout=60)
        except grpc.RpcError as e:
            expect(e.code() == grpc.StatusCode.INVALID_ARGUMENT and
                   e.details().startswith("kv_pool: index 61 is out of range"),
                   f"refused with {e.code().name}: {e.details()}")
            print(f"  refused: {e.details()}")
        else:
            raise AssertionError("a call naming member 61 of 61 was served")
    finally:
        pending.release()


@check("cleanup")
def check_cleanup(args, c):
    gone = c.unregister_set("layers")
    expect(gone == ["layers"], f"unregister_set: {gone}")
    expect(not [s for s in c.list_region_sets() if s["name"] == "layers"], "the set is listed")
    with VerifyClient(args.data, timeout=30) as other:
        c.close()
        left = [r for r in other.list_regions() if r["client"] == c.client_id]
        left += [s for s in other.list_region_sets() if s["client"] == c.client_id]
    expect(not left, f"left after close(): {left}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get("VERIFYD_DATA"))
    p.add_argument("--admin", default=os.environ.get("VERIFYD_ADMIN"))
    p.add_argument("--verifyctl", default="")
    p.add_argument("--device", type=int, default=int(os.environ.get("VERIFYD_DEVICE", "0")))
    args = p.parse_args()
    if not args.data or not args.admin:
        setup_fail("give --data and --admin (or VERIFYD_DATA and VERIFYD_ADMIN)")
    if vmm_fds.socket_path(args.data) is None:
        setup_fail(f"--data {args.data} is not a Unix socket")
    if not torch.cuda.is_available():
        setup_fail("torch sees no CUDA device")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}", flush=True)
    try:
        with AdminClient(args.admin) as admin:
            engine = admin.status()["engine"]
    except Exception as e:  # noqa: BLE001
        setup_fail(f"the daemon does not answer: {e}")
    if engine["engine"] != "cuda":
        setup_fail(f"need the CUDA engine, not {engine['engine']}")
    c = VerifyClient(args.data, timeout=300, transport="cuda_ipc")
    try:
        state = {}
        check_register(args, c, allocate_pools(device), state)
        if "set" in state:
            check_backends(c, state["set"], device)
            check_index(c, state["set"], device)
        check_cleanup(args, c)
    finally:
        c.close()
    print("\n=== summary")
    for name, ok, why in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + why if why else ''}")
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
