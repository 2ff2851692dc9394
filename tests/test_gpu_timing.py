"""nanochat/gpu_timing.py: GPU time per call from CUDA-graph replays (the benchmarks' timer)."""

import pytest
import torch

from nanochat.gpu_timing import graph_times


def test_graph_times_rejects_bad_counts():
    with pytest.raises(ValueError, match="calls and reps must be >= 1"):
        graph_times(lambda i: None, 0, 3)
    with pytest.raises(ValueError, match="warmup >= 0"):
        graph_times(lambda i: None, 1, 1, warmup=-1)


@pytest.mark.cuda
def test_graph_times_measures_gpu_time_not_host_time():
    """A kernel that spins a fixed number of cycles: per-call time does not depend on how many
    calls the graph holds, every call index is passed, and the warm-up runs outside the graph."""
    seen = []

    def spin(i):
        seen.append(i)
        torch.cuda._sleep(200_000)   # ~100 us at 2 GHz

    few = graph_times(spin, 4, 3, warmup=2)
    assert seen == [0, 1, 0, 1, 2, 3]   # warm-up calls, then the captured ones (replays run no Python)
    many = graph_times(spin, 16, 3)
    assert len(few) == 3 and min(few) > 20e-6
    assert abs(sorted(many)[1] / sorted(few)[1] - 1) < 0.2
