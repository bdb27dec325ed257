#!/usr/bin/env python3
"""bench/cuda_timing.py's span arithmetic, which the in-process benchmarks' kernel times rest on:
overlapping spans (a split combine launched early beside the kernel it combines) count once, and
kernels fall into the groups their names say. No GPU needed.

    cuda_timing_test.py
"""

import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "..", "bench")))

import cuda_timing  # noqa: E402

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def covered(spans):
    """The covered time the slow way: the integer instants some span holds."""
    return len({t for a, b in spans for t in range(a, b)})


def main():
    u = cuda_timing.union_us
    check(u([]) == 0, "no spans cover nothing")
    check(u([(10, 30), (20, 50)]) == 40, "two overlapping spans count their overlap once")
    check(u([(0, 100), (10, 20)]) == 100, "a span inside another adds nothing")
    check(u([(5, 7), (0, 2)]) == 4, "disjoint spans in any order add up")
    check(u([(0, 5), (5, 9)]) == 9, "touching spans add up")
    rng = random.Random(7)
    for n in (1, 2, 3, 17, 200):
        spans = []
        for _ in range(n):
            a = rng.randrange(0, 1000)
            spans.append((a, a + rng.randrange(0, 120)))
        check(u(spans) == covered(spans), f"{n} random spans: union {u(spans)} = {covered(spans)}")
    g = cuda_timing.kernel_group
    names = {
        "void verifyd::kernels::custom::PairSeesawKernel<verifyd::kernels::custom::TileConfig<64, "
        "64, 2>, false, true>(verifyd::kernels::custom::KernelParams)": "custom",
        "void verifyd::kernels::custom::FusedVerifyKernel<verifyd::kernels::custom::TileConfig<32,"
        " 32, 1>, false, false>(verifyd::kernels::custom::KernelParams)": "custom",
        "void verifyd::kernels::custom::CombineSplitsKernel<4>(verifyd::kernels::custom::"
        "CombineParams)": "custom",
        "(anonymous namespace)::CheckCall((anonymous namespace)::CheckArgs)": "checks",
        "(anonymous namespace)::Deliver((anonymous namespace)::DeliverArgs)": "checks",
        "void flash::flash_fwd_splitkv_mla_kernel<cutlass::bfloat16_t>(flash::Params)":
            "flashmla",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn": None,
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>":
            None,
    }
    for name, want in names.items():
        check(g(name) == want, f"{name[:60]}...: group {g(name)}, expected {want}")
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
