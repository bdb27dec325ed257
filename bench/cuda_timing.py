"""The median time of a GPU call, measured with CUDA events around each call (the benchmarks'
one way of timing what they capture or call), and the device time of groups of kernels from
CUPTI. torch is imported where a function needs it, so that the span arithmetic runs without it."""

import statistics


def median_ms(fn, reps, warmup=0):
    """``fn()`` ``warmup`` times, then ``reps`` times each between two events; the median, ms."""
    import torch  # noqa: PLC0415
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


# The groups of kernels the in-process benchmarks time, by the kernel's name: the custom kernel
# (any schedule) and its split combine, the op's own check kernels, FlashMLA's decode.
KERNEL_GROUPS = (
    ("flashmla", ("flash_fwd",)),
    ("checks", ("CheckCall", "Deliver", "CopyServed")),
    ("custom", ("FusedVerify", "PairSeesaw", "CombineSplits")),
)


def kernel_group(name):
    """The group of KERNEL_GROUPS a kernel of this name belongs to, else None."""
    for group, marks in KERNEL_GROUPS:
        if any(m in name for m in marks):
            return group
    return None


def union_us(spans):
    """The time covered by (start, end) spans, once where they overlap."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def device_us(fn, per, replays=5):
    """Device time of each group of KERNEL_GROUPS over ``replays`` calls of ``fn`` (CUPTI, through
    torch.profiler), divided by ``replays * per``: the union of the spans of the group's kernels.
    A split combine is launched early and waits inside for the kernel it combines (programmatic
    dependent launch), so summing the two kernels' times would count the overlap twice."""
    import torch  # noqa: PLC0415
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    spans = {group: [] for group, _ in KERNEL_GROUPS}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        group = kernel_group(e.name)
        if group is not None:
            spans[group].append((e.time_range.start, e.time_range.end))
    return {group: union_us(s) / (replays * per) for group, s in spans.items()}
