"""The Engine's sampler (nanochat/engine.sample_next, kth_largest) and its benchmark script."""

import pytest
import torch

from nanochat.engine import kth_largest, sample_next


def test_sample_next_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, 2, None, gen).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, None, 0.7, gen).tolist()) == {0, 1}   # 0.5 + 0.3 covers 0.7
    assert set(sample_next(logits, 1.0, None, 0.5, gen).tolist()) == {0}
    assert set(sample_next(logits, 1.0, None, None, gen).tolist()) == {0, 1, 2, 3}
    assert sample_next(logits[:1], 0.0, None, None, None).tolist() == [0]
    freq = (sample_next(logits, 1.0, None, None, gen) == 0).float().mean().item()
    assert 0.44 < freq < 0.56
    counts = torch.bincount(sample_next(logits.repeat(10, 1), 0.5, 3, None, gen), minlength=4).float() / 20000
    want = torch.tensor([0.5, 0.3, 0.15, 0.0]) ** 2
    assert torch.allclose(counts, want / want.sum(), atol=0.015), counts  # temperature 0.5: p^2, top 3
    draws = [sample_next(logits, 1.0, 3, 0.9, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])  # seeded: reproducible


def test_kth_largest_is_exact():
    """The chunked top-k equals torch.topk's k-th value: random rows, ties, -inf, a width that is
    not a multiple of the chunk, and k at the chunk size."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 5000, generator=gen)
    rows[1] = torch.randint(0, 4, (5000,), generator=gen).float()  # heavy ties
    rows[2, ::2] = float("-inf")
    for k in (1, 50, 512, 700):
        want = torch.topk(rows, k, dim=-1).values[:, -1:]
        assert torch.equal(kth_largest(rows, k), want), k


@pytest.mark.cuda
def test_sample_next_never_synchronises():
    """The Engine queues step t + 1 before reading token t: a sampler that waits for the GPU
    (torch.multinomial does, pytorch/pytorch#108968) would stall that lookahead every token."""
    logits = torch.randn(2, 32768, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kw in (dict(top_k=50, top_p=None), dict(top_k=None, top_p=0.9), dict(top_k=50, top_p=0.8)):
            sample_next(logits, 0.8, generator=gen, **kw)
        sample_next(logits, 0.0, None, None, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bench_sampler_runs_on_cpu_and_checks_flags(capsys):
    from scripts.bench_sampler import main, parse_args

    assert main(["--device", "cpu", "--calls", "2", "--vocab-size", "4096"]) == 0
    out = capsys.readouterr().out
    assert '"case": "t1 top-k 50"' in out and "kth_largest (k 50)" in out
    for argv, flag in ((["--calls", "0"], "--calls"), (["--device", "tpu"], "--device")):
        with pytest.raises(ValueError, match=flag):
            parse_args(argv)
