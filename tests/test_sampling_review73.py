"""Sampling semantics review (nanochat/sampling.py, nanochat/triton_sample.py): seeds that drew the
same tokens, NaN logits, ties at the top-p cut and the Triton noise's zero bin.

Each test failed before its fix: the CPU torch sampler keyed its generator on 32 bits of the seed
(s and s + 2**32 drew alike); the Triton sampler took seed % 2**62; a NaN logit was the greedy
token (and with top-p made token 0 the draw); top-p cut a tie group by token id; the Triton
noise's lowest bin gave E = 0, so a token of probability ~1e-13 won once per 2**24 tokens drawn.
"""

import math

import pytest
import torch

from nanochat.sampling import MAX_SEED, Sampler, SplitSeedGenerator, kth_largest, nucleus, sample_next

NAN = float("nan")


def draws(seed: int, steps: int = 12, rows: int = 1, vocab: int = 1000) -> list:
    """The tokens a CPU torch Sampler seeded `seed` draws from uniform logits, step by step."""
    sampler = Sampler(torch.device("cpu"), 1.0, None, None, seed, backend="torch")
    return [sampler(torch.zeros(rows, vocab), pos).tolist() for pos in range(steps)]


def test_cpu_seeds_use_all_64_bits():
    """mt19937 reads a seed's low 32 bits: seeds 5 and 5 + 2**32 (and 2**64 - 1, what the API's
    seed -1 maps to, and 2**32 - 1) drew the same tokens on the CPU."""
    for a, b in ((5, 5 + 2**32), (2**32 - 1, MAX_SEED), (0, 2**63), (2**40, 2**41)):
        assert draws(a) != draws(b), (a, b)
    assert draws(MAX_SEED) == draws(MAX_SEED)                    # reproducible
    # seeds below 2**32 keep their stream (row 0: a plain generator seeded with the seed)
    gen = torch.Generator().manual_seed(5)
    assert draws(5, steps=3) == [sample_next(torch.zeros(1, 1000), 1.0, None, None, gen).tolist() for _ in range(3)]
    # a sample's draws do not depend on how many are drawn beside it, with split keys too
    assert [row[:1] for row in draws(2**50 + 3, rows=3)] == draws(2**50 + 3, rows=1)


def test_seeded_draws_are_those_of_the_code_before_the_seed_fixes():
    """Pinned tokens (recorded from the code before this review, fbc1ca3) for the rows and seeds the
    fixes must leave alone: every row of a seed below 2**32 on the CPU; a review found rows >= 1
    moved to two generators (their keys are >= 2**32) and drew other tokens."""
    torch.manual_seed(0)
    logits = torch.randn(3, 1000) * 2
    for seed, want in ((7, [[427, 914, 337, 573, 583, 393, 452, 393], [472, 780, 388, 862, 162, 864, 780, 141],
                            [709, 897, 982, 337, 996, 923, 667, 408]]),
                       (2**31 + 5, [[415, 657, 337, 393, 538, 580, 452, 67], [592, 37, 275, 864, 357, 950, 835, 268],
                                    [228, 337, 372, 716, 709, 753, 450, 262]])):
        sampler = Sampler(torch.device("cpu"), 1.0, None, None, seed, backend="torch")
        got = [sampler(logits, pos).tolist() for pos in range(8)]
        assert [list(col) for col in zip(*got)] == want, seed


def test_split_seed_noise_is_exponential():
    """SplitSeedGenerator's noise: Exp(1) (mean, variance, tail), never 0, reproducible."""
    row = torch.empty(200_000)
    SplitSeedGenerator(2**40 + 7).exponential_(row)
    assert row.min() > 0 and abs(row.mean().item() - 1) < 0.01 and abs(row.var().item() - 1) < 0.03
    assert abs((row > 2).float().mean().item() - math.exp(-2)) < 0.003
    again = SplitSeedGenerator(2**40 + 7).exponential_(torch.empty(200_000))
    other = SplitSeedGenerator(2**41 + 7).exponential_(torch.empty(200_000))
    assert torch.equal(row, again) and not torch.equal(row, other)
    # and the race over it draws p: 0.5 / 0.3 / 0.2
    sampler = Sampler(torch.device("cpu"), 1.0, None, None, 2**45, backend="torch")
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.bincount(torch.cat([sampler(logits, i) for i in range(6000)]), minlength=3) / 6000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.025), counts


@pytest.mark.parametrize("top_k, top_p", [(None, None), (2, None), (None, 0.9), (3, 0.5), (1, None)])
def test_nan_logits_are_never_drawn(top_k, top_p):
    """argmax ranks NaN first: a NaN logit was the greedy token and won every race; with top-p it
    made every probability NaN and token 0 was drawn. NaN now reads as -inf."""
    logits = torch.tensor([[1.0, NAN, 0.5, 2.0, NAN]]).repeat(400, 1)
    assert sample_next(logits, 0.0, top_k, top_p, None).unique().tolist() == [3]      # greedy
    gen = torch.Generator().manual_seed(0)
    drawn = set(sample_next(logits, 1.0, top_k, top_p, gen).tolist())
    assert drawn and not drawn & {1, 4}, drawn
    if top_k is None and top_p is None:
        assert drawn == {0, 2, 3}
    sampler = Sampler(torch.device("cpu"), 0.7, top_k, top_p, 3)
    assert sampler(logits[:1], 0).item() not in (1, 4)
    # a row without a finite logit draws token 0 (in range), in every path
    assert sample_next(torch.full((1, 5), NAN), 1.0, top_k, top_p, gen).tolist() == [0]


def mass_above(probs: torch.Tensor) -> torch.Tensor:
    """Per token, the mass of the tokens strictly more likely than it (float64)."""
    p = probs.double()
    ascending = p.sort(-1).values
    cum = ascending.cumsum(-1)
    at_or_below = cum.gather(-1, torch.searchsorted(ascending, p, right=True) - 1)
    return cum[..., -1:] - at_or_below


def test_top_p_keeps_tie_groups_whole():
    """0.4, 0.2, 0.2, 0.2 at top-p 0.5: the three tied tokens are equally part of the nucleus. The
    sort-position cut kept the first of them by token id ({0, 1}): the support depended on the
    vocabulary's order, and differed from the Triton sampler's."""
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]])).repeat(6000, 1)
    gen = torch.Generator().manual_seed(1)
    counts = torch.bincount(sample_next(logits, 1.0, None, 0.5, gen), minlength=4) / 6000
    assert torch.allclose(counts, torch.tensor([0.4, 0.2, 0.2, 0.2]), atol=0.025), counts
    tied_top = torch.tensor([[2.0, 0.0, 2.0, 1.0]]).repeat(2000, 1)            # a tiny top-p: the top group
    assert set(sample_next(tied_top, 1.0, None, 1e-9, gen).tolist()) == {0, 2}
    assert set(sample_next(tied_top, 1.0, None, 1e-50, gen).tolist()) == {0, 2}   # below float32's range


def test_nucleus_matches_the_value_rule_on_bf16_ties():
    """On bf16-valued logits (ties everywhere, as the model's), nucleus() keeps exactly the tokens
    whose likelier tokens hold less than top_p, and permuting the vocabulary permutes the result."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(64, 3000, generator=gen) * 2).bfloat16().float()
    probs = torch.softmax(logits, -1)
    perm = torch.randperm(3000, generator=gen)
    for top_p in (0.3, 0.6, 0.9, 0.99):
        kept = nucleus(probs, top_p) > 0
        above = mass_above(probs)
        want = above < top_p
        ambiguous = (above - top_p).abs() < 1e-5                            # float32 sums at the edge
        assert torch.equal(kept[~ambiguous], want[~ambiguous]), top_p
        assert torch.equal(nucleus(probs[:, perm], top_p) > 0, kept[:, perm]), top_p


def test_top_k_then_top_p_and_edges():
    """top-k cuts first (ties at the k-th logit stay), top-p then over the kept tokens' softmax;
    top-k past the vocabulary is no cut; temperatures far above every logit gap stay finite."""
    logits = torch.log(torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.1]])).repeat(8000, 1)
    gen = torch.Generator().manual_seed(3)
    # top-k 4 keeps 0..4 (the 4th-largest, 0.1, is tied with token 4), renormalised; top-p 0.55
    # over that: 0 (nothing above) and 1 (0.35 above) stay, 2 (0.6 above) goes
    assert set(sample_next(logits, 1.0, 4, 0.55, gen).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, 4, None, gen).tolist()) == {0, 1, 2, 3, 4}
    assert set(sample_next(logits, 1.0, 2, 0.99, gen).tolist()) == {0, 1}
    assert torch.equal(kth_largest(logits[:1], 4), torch.log(torch.tensor([[0.1]])))
    wide = sample_next(logits, 1.0, 10**6, None, gen)                             # k > V: no cut
    assert set(wide.tolist()) == {0, 1, 2, 3, 4}
    for t in (1e20, 1e30, 1e300):                                                 # ~uniform, never nan
        counts = torch.bincount(sample_next(logits, t, None, 0.99, gen), minlength=5)
        assert counts.sum() == 8000 and counts.min() > 1200, (t, counts)


def test_padded_vocabulary_rows_are_never_sampled():
    """The lm_head has padded_vocab_size rows (128 here for 100 tokens); rows 100..127, made to
    dominate, must never reach the sampler, greedy or sampled, one sample or several."""
    from nanochat.engine import Engine
    from nanochat.gpt import GPT, config_for_depth

    torch.manual_seed(0)
    model = GPT(config_for_depth(1, 100, 64))
    assert model.lm_head.weight.size(0) == 128
    with torch.no_grad():
        model.lm_head.weight[100:] = 5.0
    engine = Engine(model, None, decode="eager")
    for kw in (dict(temperature=0.0), dict(temperature=1.5), dict(temperature=1.0, top_k=500, top_p=0.99)):
        rows, _ = engine.generate_batch([1, 2, 3], num_samples=2, max_tokens=20, seed=2**40, stop_tokens=(), **kw)
        assert all(0 <= t < 100 for row in rows for t in row), kw


# Under TRITON_INTERPRET=1, in one subprocess (conftest's `interpreted` fixture): small rows.
SEEDS_SCRIPT = r"""
import torch
from nanochat.triton_sample import row_draw_table, sample_triton, seed_halves

uniform = torch.zeros(8, 100)
def draw(seed, pos=3):
    return sample_triton(uniform, 1.0, None, None, seed, pos).tolist()
# seed % 2**62 made s and s + 2**62 draw alike; every half of the seed now counts
for a, b in ((7, 7 + 2**62), (2**32 - 1, 2**64 - 1), (5, 5 + 2**32), (0, 2**63)):
    assert draw(a) != draw(b), (a, b)
assert draw(2**64 - 1) == draw(2**64 - 1)
assert seed_halves(2**64 - 1) == (-1, -1) and seed_halves(2**31) == (0, 1) and seed_halves(5 + 2**32) == (5, 2)
assert seed_halves(2**62) == (-2**31, 0) and seed_halves(2**63) == (0, -2**31)
# below 2**62 the words the kernels always took (seed % 2**62 split at bit 31): seeds draw as before
for s in (0, 7, 2**31 - 1, 2**31 + 5, 3_000_000_000, 2**40 + 3, 2**62 - 1):
    assert seed_halves(s) == (s & 0x7FFFFFFF, s >> 31), s
# pinned tokens of the code before this review (fbc1ca3): seeds below 2**62 draw what they drew
torch.manual_seed(0)
pinned = torch.randn(4, 1024) * 2
for s, want in ((0, [0, 538, 538, 393, 337, 393, 605, 909, 59, 942, 270, 909]),
                (3_000_000_000, [337, 393, 601, 909, 59, 393, 337, 864, 452, 273, 393, 69])):
    got = [int(sample_triton(pinned, 1.0, None, None, s, position=p)[0]) for p in range(12)]
    assert got == want, (s, got)
for bad in (-1, 2**64, 1.5, True):
    try:
        sample_triton(uniform, 1.0, None, None, bad, 0)
        raise SystemExit(f"seed {bad!r} was accepted")
    except ValueError as e:
        assert "seed" in str(e)
# per-row draws with halves past int32's positive range equal the rows' own calls
g = torch.Generator().manual_seed(0)
mixed = torch.randn(3, 130, generator=g) * 3
for k in (None, 20):
    alone = [sample_triton(mixed[0:1], 0.9, k, None, 2**64 - 1, 9), sample_triton(mixed[1:2], 0.9, k, None, 2**31, 4),
             sample_triton(mixed[2:3], 0.9, k, None, 3 * 2**32 + 2**31 + 1, 70)]
    table = row_draw_table([(2**64 - 1, 9, 0), (2**31, 4, 0), (3 * 2**32 + 2**31 + 1, 70, 0)])
    assert torch.equal(sample_triton(mixed, 0.9, k, None, 0, 0, row_draws=table, chunk=64), torch.cat(alone)), k
print("OK")
"""

NAN_SCRIPT = r"""
import torch
from nanochat.triton_sample import sample_triton

nan = float("nan")
g = torch.Generator().manual_seed(1)
rows = torch.randn(4, 130, generator=g) * 2   # two-stage at chunk 64: 3 chunks, the last partial
rows[0, 5] = nan
rows[0, 6] = 50.0                         # the finite winner of row 0
rows[1, ::7] = nan
rows[2, :] = nan
rows[2, 17] = 0.0                         # one finite logit
rows[3, 60:70] = nan                      # a NaN run inside one chunk, in front of the winner
rows[3, 70] = 40.0
nans = rows.isnan()
assert sample_triton(rows, 0.0, None, None, 1, 2).tolist()[:3] == [6, rows[1].nan_to_num(-1e9).argmax().item(), 17]
for T, k, p in ((1.0, None, None), (1.0, 5, None), (0.8, 5, 0.9)):
    one = sample_triton(rows, T, k, p, 4, 0, chunk=0)
    two = sample_triton(rows, T, k, p, 4, 0, chunk=64)
    assert torch.equal(one, two), (T, k, p, one, two)
    assert not nans.gather(1, one[:, None]).any(), (T, k, p, one)
    assert one[2] == 17 and one[3] == 70, (T, k, p, one)
print("OK")
"""

# The Triton noise's zero bin: the hash is inverted to find a (seed, position, token) whose bin is
# the lowest, u = 0, where E = -log(1 - u) was 0 and that token won whatever its probability.
ZERO_BIN_SCRIPT = r"""
import torch
from nanochat.triton_sample import sample_triton

M = 0xFFFFFFFF
def mix(x):
    x ^= x >> 16; x = x * 0x7FEB352D & M; x ^= x >> 15; x = x * 0x846CA68B & M; return x ^ (x >> 16)
def unmix(x):
    x ^= x >> 16; x = x * pow(0x846CA68B, -1, 2**32) & M; x ^= (x >> 15) ^ (x >> 30)
    x = x * pow(0x7FEB352D, -1, 2**32) & M; return x ^ (x >> 16)
assert all(unmix(mix(v)) == v for v in (0, 1, 12345, M, 2**31 + 7))
V = 64
# row 0, token t: h = mix(mix(t ^ k)) with k = mix(lo ^ mix(hi ^ mix(pos))); k = t gives h = 0.
# hi = 0 and lo < 2**31 give the same key under the old seed split (seed & 0x7FFFFFFF, seed >> 31)
seed, pos, t = next((lo, pos, t) for pos in range(50) for t in range(1, V)
                    for lo in [unmix(t) ^ mix(mix(pos))] if lo < 2**31)
assert mix(mix(t ^ mix(seed ^ mix(0 ^ mix(pos))))) >> 8 == 0
logits = torch.full((1, V), -30.0)
logits[0, 0] = 0.0                        # token t has probability e^-30 ~ 1e-13
for k in (None, 2):                       # top-k 2 keeps every tied -30 token too
    got = sample_triton(logits, 1.0, k, None, seed, pos).item()
    assert got == 0, (seed, pos, t, got)
print("OK")
"""

# ties at the top-p cut: the Triton sampler and sample_next keep the same tokens
TIES_SCRIPT = r"""
import torch
from nanochat.sampling import kth_largest, nucleus
from nanochat.triton_sample import sample_triton

g = torch.Generator().manual_seed(2)
rows = torch.randint(0, 8, (3, 64), generator=g).float() * 0.5      # heavy ties
rows[2] = torch.log(torch.tensor([0.4] + [0.6 / 63] * 63))          # 0.4, then 63 tied
for T, k, p in ((1.0, None, 0.5), (1.3, 20, 0.6), (1.0, None, 0.3)):
    keep = torch.zeros(3, 64, dtype=torch.int8)
    sample_triton(rows, T, k, p, 5, 1, keep_out=keep)
    x = rows if k is None else rows.masked_fill(rows < kth_largest(rows, k), float("-inf"))
    want = nucleus(torch.softmax(x / T, -1), p) > 0
    assert torch.equal(keep.bool(), want), (T, k, p, (keep.bool() != want).sum(-1))
print("OK")
"""

SCRIPTS = {"SEEDS_SCRIPT": SEEDS_SCRIPT, "NAN_SCRIPT": NAN_SCRIPT, "ZERO_BIN_SCRIPT": ZERO_BIN_SCRIPT,
           "TIES_SCRIPT": TIES_SCRIPT}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_triton_sampler_in_interpreter(interpreted, name):
    assert interpreted[name] is None, interpreted[name]


@pytest.mark.cuda
def test_triton_zero_bin_on_gpu():
    """20,000 rows of 32768 tokens, one of probability ~1 and the rest e^-30 each (3e-9 in all):
    the lowest noise bin drew a rest token ~39 times (20000 x 32768 / 2**24); now never."""
    from nanochat.triton_sample import sample_triton

    logits = torch.full((20000, 32768), -30.0, device="cuda")
    logits[:, 123] = 0.0
    for pos in range(3):
        drawn = sample_triton(logits, 1.0, None, None, 11, pos)
        assert (drawn != 123).sum().item() == 0, pos


@pytest.mark.cuda
def test_seeds_and_nan_on_gpu():
    """On the GPU: torch (Philox, 64-bit keys) and Triton seeds that used to collide draw apart; NaN
    is never drawn by the compiled kernels (one-program and two-stage paths agree) or greedily."""
    from nanochat.triton_sample import sample_triton

    uniform = torch.zeros(64, 32768, device="cuda")
    for a, b in ((7, 7 + 2**62), (2**32 - 1, MAX_SEED), (5, 5 + 2**32)):
        assert not torch.equal(sample_triton(uniform, 1.0, None, None, a, 0),
                               sample_triton(uniform, 1.0, None, None, b, 0)), (a, b)
        ta, tb = (Sampler(uniform.device, 1.0, None, None, s, backend="torch")(uniform, 0) for s in (a, b))
        assert not torch.equal(ta, tb), (a, b)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(8, 32768, device="cuda", generator=gen) * 3
    rows[:, ::5] = NAN
    rows[0] = NAN
    rows[0, 999] = 0.0
    nans = rows.isnan()
    for backend in ("torch", "triton"):
        assert Sampler(rows.device, 0.0, None, None, 0, backend=backend)(rows, 0)[0].item() == 999
    for k, p in ((None, None), (50, None), (50, 0.9), (None, 0.8)):
        for pos in range(4):
            two = sample_triton(rows, 1.0, k, p, 3, pos)
            assert torch.equal(two, sample_triton(rows, 1.0, k, p, 3, pos, chunk=0)), (k, p, pos)
            assert not nans.gather(1, two[:, None]).any() and two[0].item() == 999
            torch_draw = sample_next(rows, 1.0, k, p, gen)
            assert not nans.gather(1, torch_draw[:, None]).any()
