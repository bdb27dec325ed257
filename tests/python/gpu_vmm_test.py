#!/usr/bin/env python3
"""The cuda_ipc transport with tensors in torch's expandable segments (CUDA VMM allocations)
against a running verifyd with the CUDA engine.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True VERIFYD_CLIENT_GEN=BUILD/clients/python/gen \\
    python3 tests/python/gpu_vmm_test.py --data unix:///tmp/vd/verifyd.sock \\
        --admin unix:///tmp/vd/admin.sock [--device 0]

The data address must be verifyd's Unix socket (the chunks' descriptors go to its descriptor
socket, PATH.fds). PYTORCH_CUDA_ALLOC_CONF is set to expandable_segments:True when unset.

Checks, each reported PASS/FAIL with its reason:
  chunks      a KV pool of about 320 MB lives in an expandable segment: cuIpcGetMemHandle
              refuses it; its bytes are backed by several chunks, side by side, each a multiple
              of the granularity
  equal       the pool registered through the cuda_ipc transport (a VMM region of the pool's
              size), and the calls on it (pages scattered over every chunk), q in a registered
              buffer and the staging slots (VMM too) give the inline transport's outputs bit
              for bit
  token       RegisterCudaVmmRegion with a token that was never sent is refused naming `token`
  cleanup     close() unregisters every region of the client
Exit status: 0 all passed, 1 a check failed, 2 the setup failed.
"""

import argparse
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The helpers of the cuda_ipc test (stubs, checks, bit-for-bit comparison); torch is imported
# there, after the allocator setting above.
from gpu_cuda_ipc_test import (RESULTS, assert_same, bf16_cuda, check, expect,  # noqa: E402
                               setup_fail, torch_bundle)

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from random_bundles import random_bundle  # noqa: E402
from verifyd_client import AdminClient, VerifyClient, VerifydError  # noqa: E402
from verifyd_client import cuda_driver, vmm_fds  # noqa: E402

# 4,300 unused pages of 64 tokens: a pool of about 320 MB, 16 or so 20 MB chunks.
SHAPES = [dict(batch=3, draft=17, heads=8, page_size=64, prefixes=[97, 1, 540],
               unused_pages=4300, spare_pages=1, share_first_page=True),
          dict(batch=2, draft=5, heads=16, page_size=64, prefixes=[2000, 37], unused_pages=4300)]


@check("chunks")
def check_chunks(device):
    pool = torch.empty(320 << 20, dtype=torch.uint8, device=device)
    ptr, n = pool.data_ptr(), pool.numel()
    expect(cuda_driver.is_vmm(ptr), "the pool is not in a VMM allocation: expandable segments "
                                    "are not in effect (PYTORCH_CUDA_ALLOC_CONF)")
    try:
        base, _, _ = cuda_driver.allocation(ptr)
        cuda_driver.ipc_handle(base)
        raise AssertionError("cuIpcGetMemHandle exported an expandable segment")
    except cuda_driver.CudaDriverError as e:
        print(f"  legacy IPC refused, as expected: {e}")
    chunks = cuda_driver.vmm_chunks(ptr, n)
    try:
        sizes = [size for _, size, _ in chunks]
        print(f"  {len(chunks)} chunks: {sorted(set(sizes))} bytes; tensor at "
              f"+{ptr - chunks[0][0]} in the first")
        expect(len(chunks) >= 2, f"{len(chunks)} chunk(s) behind 320 MB")
        expect(chunks[0][0] <= ptr and ptr + n <= chunks[-1][0] + chunks[-1][1],
               "the chunks do not cover the tensor")
        for (a, s, _), (b, _, _) in zip(chunks, chunks[1:]):
            expect(a + s == b, f"chunks not side by side at {a + s:#x} / {b:#x}")
        expect(len({h for _, _, h in chunks}) == len(chunks), "a handle repeats")
        expect(all(s % (2 << 20) == 0 for s in sizes), f"a chunk size is not 2 MB-aligned: {sizes}")
    finally:
        cuda_driver.release_handles(chunks)


def my_regions(c):
    return [r for r in c.list_regions() if r["client"] == c.client_id]


@check("equal")
def check_equal(args, device):
    rng = np.random.default_rng(77)
    with VerifyClient(args.data, timeout=300) as inline, \
            VerifyClient(args.data, timeout=300, transport="cuda_ipc") as c:
        for i, shape in enumerate(SHAPES):
            b = random_bundle(rng, **shape)
            tb = torch_bundle(b, device)
            pool = c.register_kv_pool(tb["kv_pool"])
            expect(cuda_driver.is_vmm(pool.data_ptr()), "the pool is not in a VMM allocation")
            nbytes = pool.numel() * 2
            regions = {r["byte_size"]: r for r in my_regions(c)}
            expect(nbytes in regions and regions[nbytes]["kind"] == "cuda_ipc",
                   f"no cuda_ipc region of the pool's {nbytes} bytes: {list(regions)}")
            print(f"  shape {i}: pool {nbytes / 1e6:.0f} MB registered as "
                  f"'{regions[nbytes]['name']}' ({regions[nbytes]['owner']})")
            for want_lse in (False, True):
                want = inline.verify(**b, want_lse=want_lse, compact=False, device=device.index)
                got = c.verify(**dict(tb, kv_pool=pool), want_lse=want_lse)
                assert_same(got, want, f"shape {i} want_lse={want_lse}")
            # q in a registered buffer (a VMM region of its own): named in place.
            qbuf = c.register_buffer(torch.empty(4 << 20, dtype=torch.bfloat16, device=device))
            q = qbuf[:tb["q"].numel()].view(tb["q"].shape)
            q.copy_(tb["q"])
            assert_same(c.verify(**dict(tb, q=q, kv_pool=pool), want_lse=True),
                        inline.verify(**b, want_lse=True, compact=False, device=device.index),
                        f"shape {i} q in place")
            print(f"  shape {i}: {len(b['kv_indices'])} pages over the pool, equal bit for bit")
        print(f"  regions of this client: {len(my_regions(c))}")


@check("token")
def check_token(args, device):
    with VerifyClient(args.data, timeout=60, transport="cuda_ipc") as c:
        try:
            c._regions.register_cuda_vmm("vmm-no-token", vmm_fds.new_token(), [20 << 20],
                                         device.index, 0, 1 << 20, c.client_id)
        except VerifydError as e:
            expect(e.code == grpc.StatusCode.NOT_FOUND and e.field == "token",
                   f"refused with {e.code.name} {e.message!r}, expected NOT_FOUND naming token")
            print(f"  refused: {e.message}")
        else:
            raise AssertionError("a token never sent was accepted")


@check("cleanup")
def check_cleanup(args, device):
    c = VerifyClient(args.data, timeout=120, transport="cuda_ipc")
    b = random_bundle(np.random.default_rng(5), **SHAPES[1])
    c.verify(**torch_bundle(b, device))
    expect(my_regions(c), "no region registered")
    with VerifyClient(args.data, timeout=30) as other:
        c.close()
        left = [r for r in other.list_regions() if r["client"] == c.client_id]
    expect(not left, f"regions left after close(): {left}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get("VERIFYD_DATA"))
    p.add_argument("--admin", default=os.environ.get("VERIFYD_ADMIN"))
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
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}; data {args.data}",
          flush=True)
    try:
        with AdminClient(args.admin) as admin:
            engine = admin.status()["engine"]
    except Exception as e:  # noqa: BLE001
        setup_fail(f"the daemon does not answer: {e}")
    if engine["engine"] != "cuda":
        setup_fail(f"need the CUDA engine, not {engine['engine']}")
    check_chunks(device)
    check_equal(args, device)
    check_token(args, device)
    check_cleanup(args, device)
    print("\n=== summary")
    for name, ok, why in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + why if why else ''}")
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
