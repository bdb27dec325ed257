"""The median time of a GPU call, measured with CUDA events around each call (the benchmarks'
one way of timing what they capture or call)."""

import statistics

import torch


def median_ms(fn, reps, warmup=0):
    """``fn()`` ``warmup`` times, then ``reps`` times each between two events; the median, ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
