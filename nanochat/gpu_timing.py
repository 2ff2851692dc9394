"""GPU time of a sequence of launches without the host's share: the calls are captured once in a
CUDA graph and the graph is replayed between CUDA events. This is what a kernel costs inside a
graphed decode step; a Python loop of launches times the host instead (5-30 us per call, more
than many decode kernels take). Used by bench_int8, bench_sampler and bench_decode_kernel.
"""

from __future__ import annotations

from typing import Callable

import torch


def graph_times(fn: Callable[[int], object], calls: int, reps: int, *, warmup: int = 1) -> list[float]:
    """Seconds per call for each of `reps` replays of one CUDA graph holding fn(0), ...,
    fn(calls - 1). fn(0..warmup-1) run first on a side stream, so compiles, autotuning and
    allocations happen outside the capture. A capture torch refuses (e.g. its RNG with a private
    generator) raises RuntimeError."""
    if calls < 1 or reps < 1 or warmup < 0:
        raise ValueError(f"graph_times: calls and reps must be >= 1 and warmup >= 0, got {calls}, {reps}, {warmup}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()   # the first replay uploads the graph
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return times
