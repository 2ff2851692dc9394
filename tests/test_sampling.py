"""The samplers (nanochat/sampling.py: sample_next, kth_largest, Sampler; nanochat/triton_sample.py)
and their benchmark script."""

import pytest
import torch

from nanochat.sampling import Sampler, kth_largest, resolve_sampler, sample_next


def reference_support(logits, temperature, top_k, top_p):
    """Which tokens sample_next can draw (top-k, then top-p over the softmax, probability > 0)."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        logits = logits.masked_fill(logits < kth_largest(logits, top_k), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum(-1, keepdim=True)


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


def test_tiny_temperatures_are_greedy():
    """A positive temperature far below any logit gap is the argmax in both samplers: 1e-39 used
    to overflow logits / T to inf and draw token 0 (nan probabilities with top-p)."""
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9]])
    gen = torch.Generator().manual_seed(0)
    for t in (1e-39, 5e-324, 1e-30, 1e-6):
        for top_k, top_p in ((None, None), (2, None), (None, 0.9), (3, 0.5)):
            assert sample_next(logits, t, top_k, top_p, gen).tolist() == [1], (t, top_k, top_p)
        sampler = Sampler(torch.device("cpu"), t, 50, 0.9, seed=0)
        assert sampler.temperature == 0.0 and sampler(logits, 0).tolist() == [1]


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


def test_resolve_sampler_and_engine_flag():
    cpu = torch.device("cpu")
    assert resolve_sampler("auto", cpu) == "torch" and resolve_sampler("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="sampler: 'triton' needs a CUDA device.*auto|torch"):
        resolve_sampler("triton", cpu)
    with pytest.raises(ValueError, match="sampler: got 'fast'; accepted: auto|torch|triton"):
        resolve_sampler("fast", cpu)
    sampler = Sampler(cpu, 1.0, 3, None, seed=5)
    logits = torch.randn(4, 100)
    assert sampler.backend == "torch" and sampler(logits, 0).shape == (4,)
    sampler.warmup(100)  # torch: nothing to compile
    cuda = torch.device("cuda")  # resolution reads no device state: no GPU needed
    pytest.importorskip("triton")
    assert resolve_sampler("auto", cuda, 32768) == "triton" and resolve_sampler("auto", cuda, 40000) == "torch"
    with pytest.raises(ValueError, match="up to 32768 tokens; this vocabulary has 40000"):
        resolve_sampler("triton", cuda, 40000)
    from nanochat.engine import Engine
    from nanochat.gpt import GPT, config_for_depth

    model = GPT(config_for_depth(1, 256, 64))
    assert Engine(model).sampler_backend == "torch"
    with pytest.raises(ValueError, match="sampler: 'triton' needs a CUDA device"):
        Engine(model, sampler="triton")


# Runs under TRITON_INTERPRET=1 (one program per row, slow: few, short rows; the interpreter runs
# tl.reduce's combine function in Python). Checks which tokens the
# kernel can draw (keep_out) against the torch definition, and that draws are keyed by position.
TRITON_SAMPLER_SCRIPT = r"""
import torch
from tests.test_sampling import reference_logits_k, reference_support
from nanochat.triton_sample import sample_triton

g = torch.Generator().manual_seed(0)
rows = torch.randn(4, 100, generator=g) * 2
rows[1] = torch.randint(0, 6, (100,), generator=g).float()   # heavy ties
rows[2, ::3] = float("-inf")
for T, k, p in [(1.0, 50, None), (0.7, None, 0.9), (1.3, 40, 0.5), (0.9, 1, None), (1.0, 100, None)]:
    keep = torch.zeros(4, 100, dtype=torch.int8)
    drawn = sample_triton(rows, T, k, p, 5, 11, keep_out=keep)
    assert keep.gather(1, drawn[:, None]).all(), (T, k, p)   # draws only where allowed
    want = reference_support(rows, T, k, p) > 0
    exact = [0, 2, 3] if p is not None else [0, 1, 2, 3]     # top-p: tied tokens go together (row 1)
    assert torch.equal(want[exact], keep[exact].bool()), (T, k, p, (want[exact] != keep[exact].bool()).sum())
    if p is not None:  # row 1: whole tie groups, the ones whose higher-ranked mass is below p
        probs = torch.softmax(rows[1:2] / T if k is None else reference_logits_k(rows[1:2] / T, k), -1)[0]
        above = torch.stack([probs[probs > v].sum() for v in probs])
        assert torch.equal(keep[1].bool(), above < p - 1e-6), (T, k, p)
assert torch.equal(sample_triton(rows, 0.0, 5, 0.5, 1, 2), rows.argmax(-1))   # greedy
assert torch.equal(sample_triton(rows, 5e-324, 5, 0.5, 1, 2), rows.argmax(-1))  # and below GREEDY_BELOW
uniform = torch.zeros(32, 1000)
a, b, c = (sample_triton(uniform, 1.0, None, None, 7, pos) for pos in (3, 3, 4))
assert torch.equal(a, b) and not torch.equal(a, c)                             # keyed by position
assert not torch.equal(a, sample_triton(uniform, 1.0, None, None, 8, 3))       # and by seed
assert len(set(a.tolist())) > 25                                               # rows draw apart
freq = (sample_triton(torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(200, 1), 1.0, None, None, 3, 9) == 0)
assert 0.38 < freq.float().mean() < 0.62
# row_draws: rows of different requests in one call draw what each request's own call draws
# (one-program path and, with top-k 20 at V = 1000, the two-stage one)
from nanochat.triton_sample import row_draw_table
mixed = torch.randn(5, 1000, generator=g) * 3
for k in (None, 20):
    alone = [sample_triton(mixed[0:2], 0.8, k, None, 123, 40),     # a request of two samples
             sample_triton(mixed[2:3], 0.8, k, None, 7, 12),       # and two of one sample
             sample_triton(mixed[3:5], 0.8, k, None, 2**40 + 5, 300)[:1]]
    table = row_draw_table([(123, 40, 0), (123, 40, 1), (7, 12, 0), (2**40 + 5, 300, 0)])
    together = sample_triton(mixed[:4], 0.8, k, None, 0, 0, row_draws=table)
    assert torch.equal(together, torch.cat(alone)), (k, together, alone)
print("OK")
"""


# The two-stage top-k sampler against the one-program one, under the interpreter: V = 180 in
# chunks of 64 (the last one partial; 3 chunks, not a power of two, so stage 2 masks the padding
# chunk), random rows, -inf runs and a row of heavy ties whose candidates overflow their slots
# (the fallback draws it). V is small because the interpreter's top-p search costs V per row.
TWO_STAGE_SCRIPT = r"""
import torch
from tests.test_sampling import reference_support
from nanochat.triton_sample import TWO_STAGE_MAX_K, sample_triton, two_stage_plan

assert two_stage_plan(300, 5, 64) == (64, 5, 16) and two_stage_plan(300, 20, 64) == (64, 5, 32)
assert two_stage_plan(300, 40, 64) is None                      # 64 slots would fill a chunk
assert two_stage_plan(32768, 50) == (1024, 32, 64) and two_stage_plan(32768, None) is None
try:
    two_stage_plan(32768, 50, chunk=1000)
    raise SystemExit("a chunk that is not a power of two was accepted")
except ValueError as e:
    assert "chunk 1000" in str(e)
assert two_stage_plan(32768, TWO_STAGE_MAX_K + 1) is None and two_stage_plan(32768, 50, chunk=0) is None
assert two_stage_plan(1000, 50) is None                          # one chunk
g = torch.Generator().manual_seed(0)
assert two_stage_plan(180, 16, 64) == (64, 3, 16)
rows = torch.randn(4, 180, generator=g) * 2
rows[1] = torch.randint(0, 3, (180,), generator=g).float()       # ~21 ties per chunk: overflow
rows[2, ::3] = float("-inf")
rows[3, 3:179] = float("-inf")                                   # 4 finite tokens, fewer than most k
for T, k, p, pos in [(1.0, 5, None, 1), (0.7, 13, None, 2), (1.3, 1, None, 3), (1.0, 16, 0.6, 4)]:
    keep1, keep2 = torch.zeros(4, 180, dtype=torch.int8), torch.ones(4, 180, dtype=torch.int8)
    fell = torch.zeros(4, dtype=torch.int32)
    one = sample_triton(rows, T, k, p, 5, pos, keep_out=keep1, chunk=0)
    two = sample_triton(rows, T, k, p, 5, pos, keep_out=keep2, chunk=64, fallback_out=fell)
    assert fell.tolist() == [0, 1, 0, 0], (k, fell)
    assert torch.equal(one, two), (T, k, p, one, two)
    assert torch.equal(keep1, keep2), (T, k, p)
    want = reference_support(rows, T, k, p) > 0
    assert torch.equal(want[[0, 2, 3]], keep2[[0, 2, 3]].bool()), (T, k, p)
    assert keep2.gather(1, two[:, None]).all()
print("OK")
"""


# Both scripts run in one interpreted subprocess (conftest's `interpreted` fixture).
SCRIPTS = {"TRITON_SAMPLER_SCRIPT": TRITON_SAMPLER_SCRIPT, "TWO_STAGE_SCRIPT": TWO_STAGE_SCRIPT}


def test_triton_two_stage_sampler_in_interpreter(interpreted):
    assert interpreted["TWO_STAGE_SCRIPT"] is None, interpreted["TWO_STAGE_SCRIPT"]


def reference_logits_k(logits, k):
    return logits.masked_fill(logits < kth_largest(logits, k), float("-inf"))


def test_triton_sampler_in_interpreter(interpreted):
    assert interpreted["TRITON_SAMPLER_SCRIPT"] is None, interpreted["TRITON_SAMPLER_SCRIPT"]


@pytest.mark.cuda
def test_triton_sampler_distribution_and_no_sync():
    """The Triton sampler's empirical distribution equals sample_next's (20,000 draws per setting,
    a 4096-token row), it never synchronises with the host, a re-run at the same position draws
    the same tokens, and with top-k the two-stage path draws what the one-program path draws
    (32768-token rows, k up to 256, ties that take the fallback)."""
    from nanochat.triton_sample import sample_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    row = torch.randn(1, 4096, device="cuda", generator=gen) * 2
    rows = row.expand(20000, -1)
    for T, k, p in [(0.8, 50, None), (1.0, None, 0.9), (1.2, 20, 0.8), (1.0, None, None)]:
        want = reference_support(row, T, k, p)[0]
        drawn = sample_triton(rows, T, k, p, seed=1, position=100)
        freq = torch.bincount(drawn, minlength=4096).float() / drawn.numel()
        assert (freq[want == 0] == 0).all(), (T, k, p)
        assert (freq - want).abs().max() < 0.012, (T, k, p, (freq - want).abs().max())
        assert torch.equal(drawn, sample_triton(rows, T, k, p, seed=1, position=100))
    big = torch.randn(8, 32768, device="cuda", generator=gen) * 3
    big[1] = torch.randint(0, 3, (32768,), device="cuda", generator=gen).float()  # ties: the fallback
    big[2, 100:] = float("-inf")                                                   # 100 finite tokens
    for k in (1, 50, 256):  # the two-stage path draws what the one-program path draws
        for pos in range(5):
            fell = torch.zeros(8, dtype=torch.int32, device="cuda")
            two = sample_triton(big, 0.9, k, None, 4, pos, fallback_out=fell)
            assert torch.equal(two, sample_triton(big, 0.9, k, None, 4, pos, chunk=0)), (k, pos)
            assert fell.tolist() == [0, 1] + [0] * 6, (k, fell)
    Sampler(big.device, 1.0, 1, 0.5, 0).warmup(32768)  # compiled here: no sync checks on that
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kw in (dict(top_k=50, top_p=None), dict(top_k=None, top_p=0.9), dict(top_k=50, top_p=0.8)):
            Sampler(big.device, 0.8, seed=3, backend="triton", **kw)(big, 7)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="vocabulary 40000"):
        Sampler(big.device, 1.0, None, None, 0, backend="triton")(torch.zeros(1, 40000, device="cuda"), 0)
