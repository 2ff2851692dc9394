"""Drawing the next token from logits: temperature, top-k, top-p and the draw itself.

One distribution, two implementations: softmax(logits / T) restricted to the top-k logits (every
logit equal to the k-th largest stays), then to the nucleus: the tokens whose strictly more likely
tokens hold less than top_p of the mass (tokens of equal probability stay or go together, so the
cut never depends on token ids); T = 0 is greedy (the argmax, ties to the lowest id). A NaN logit
is never drawn (read as -inf); a row with no finite logit draws token 0. Logits must not be +inf
(the model's softcap bounds them).
  * `sample_next` (torch, any device): the exponential race argmax_i p_i / E_i, E_i ~ Exp(1)
    i.i.d., which picks i with probability p_i exactly and, unlike torch.multinomial
    (pytorch/pytorch#108968), never synchronises with the host. Noise from a torch.Generator,
    or one per row (what `Sampler` passes: row r's is keyed by `row_seed(seed, r)`, `row_generator`).
  * `triton_sample.sample_triton` (CUDA, vocabularies up to 32768): the same race in one Triton
    launch per step, three with top-k's two-stage path (~8 torch kernels otherwise), noise
    hashed from (seed, position, row, token).
`Sampler` is what the Engine holds per generation; `backend` auto takes the Triton kernel on
CUDA (where Triton imports and the vocabulary fits) and torch elsewhere. Either way a generation
is reproducible from its seed, and a sample's noise does not depend on how many samples are drawn
beside it: sample 0 of `num_samples=4` is the `num_samples=1` answer up to the batched model
step's float rounding (Triton: the noise hashes the row; torch: a generator per row, where one
generator shared by the rows gave row 0 other noise as soon as a second row took its share).

Seeds (0..MAX_SEED) and their streams: every seed has its own. The torch sampler on CUDA keys a
Philox generator with all 64 bits; on the CPU a torch.Generator (mt19937) reads only the low 32,
so sample 0 of a seed >= 2**32 draws from two generators, one per half (`SplitSeedGenerator`;
seeds s and s + 2**32 drew the same tokens), while samples r >= 1, keyed by a splitmix of (seed,
r) whose low 32 bits depend on every bit of the seed, keep one generator (and the tokens they drew
before). The Triton sampler hashes all 64 bits (it used seed % 2**62, so s and s + 2**62 drew the
same tokens; seeds below 2**62 draw what they drew). The three noise sources differ: one seed gives
the same distribution but other tokens on the CPU, with the torch sampler on CUDA and with the
Triton one. Where streams meet by design: the torch sampler's sample r >= 1 of seed s draws what
sample 0 of seed row_seed(s, r) draws (a stream per key, not per (seed, row)).
"""

from __future__ import annotations

import torch

TOPK_CHUNK = 512
SAMPLER_BACKENDS = ("auto", "torch", "triton")
# Below this temperature sampling is greedy. Softcapped logits differ by far more than 1e-5 x the
# float32 resolution, so the draw there is the argmax anyway; and logits / T overflows float32 to
# inf once T < ~1e-37 (a request's 1e-39 drew token 0 over nan probabilities).
GREEDY_BELOW = 1e-5
# Above this temperature the draw is already uniform over the kept tokens (tempered logits differ by
# far less than the noise's float32 resolution), so sample_next caps T here: past float32's range
# (~3.4e38) T itself became inf, every tempered logit 0 or nan, and top-k / top-p kept every token.
MAX_TEMPERATURE = 1e30
# Seeds a torch.Generator takes (manual_seed reads a uint64; 2**64 raised "Overflow when unpacking
# long long" at the first token, inside the generation).
MAX_SEED = 2**64 - 1


def row_seed(seed: int, row: int) -> int:
    """The torch sampler's noise key (row_generator) of sample `row` of a generation seeded `seed`:
    `seed` itself for row 0 (a one-sample generation draws what it always drew), a splitmix64 mix
    of (seed, row) for the others, so neighbouring seeds' rows do not share streams."""
    if row == 0:
        return seed
    x = (seed + row * 0x9E3779B97F4A7C15) & MAX_SEED
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MAX_SEED
    return x ^ (x >> 31)


class SplitSeedGenerator:
    """The CPU noise of a 64-bit key >= 2**32: a torch.Generator (mt19937) reads only a seed's low
    32 bits, so one generator per half; their 52-bit integers added mod 2**52 are uniform and keyed
    by all 64 bits (equal noise for two keys would be a coincidence over every token). Bit for bit
    reproducible from the key, like a generator."""

    BITS = 52   # u = (n + 1/2) / 2**52 is exact in float64 and inside (0, 1): E = -log(u) > 0

    def __init__(self, seed: int):
        self.lo = torch.Generator().manual_seed(seed & 0xFFFFFFFF)
        self.hi = torch.Generator().manual_seed(seed >> 32)

    def exponential_(self, row: torch.Tensor) -> torch.Tensor:
        """Fill `row` (a CPU tensor) with Exp(1) noise; returns it."""
        n = torch.randint(0, 1 << self.BITS, row.shape, generator=self.lo)
        n.add_(torch.randint(0, 1 << self.BITS, row.shape, generator=self.hi)).bitwise_and_((1 << self.BITS) - 1)
        return row.copy_(n.double().add_(0.5).mul_(2.0 ** -self.BITS).log_().neg_())


def row_generator(device: torch.device, key: int):
    """The noise source of one row keyed `key` (0..MAX_SEED): a torch.Generator seeded with it,
    or on the CPU, for a key past mt19937's 32 bits, a SplitSeedGenerator."""
    device = torch.device(device)
    if device.type == "cpu" and key >> 32:
        return SplitSeedGenerator(key)
    return torch.Generator(device=device).manual_seed(key)


def _exponential_noise(logits: torch.Tensor, generator) -> torch.Tensor:
    """Exp(1) noise shaped like `logits` (B, V): from one generator, or row r from `generator[r]`
    (a torch.Generator or a SplitSeedGenerator)."""
    noise = torch.empty_like(logits)
    if generator is None or isinstance(generator, torch.Generator):
        noise.exponential_(generator=generator)
    else:
        if len(generator) < noise.size(0):
            raise ValueError(f"sample_next: {len(generator)} generators for {noise.size(0)} rows")
        for row, gen in zip(noise, generator):
            if isinstance(gen, SplitSeedGenerator):
                gen.exponential_(row)
            else:
                row.exponential_(generator=gen)
    # E >= the smallest normal float: log(0) would turn a masked -inf logit into nan
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def nan_as_masked(logits: torch.Tensor) -> torch.Tensor:
    """`logits` with NaN read as -inf (never drawn). argmax ranks NaN above every number, so one
    NaN logit (a broken lm_head row, a quantisation overflow) was the greedy and the race's token
    at every step, and with top-p it made every probability NaN and token 0 was drawn."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy draw of each row of `logits` (B, V): the argmax (ties: the lowest id), NaN never."""
    return nan_as_masked(logits).argmax(dim=-1)


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def greedy_if_top_p_zero(temperature: float, top_p: float | None) -> tuple[float, float | None]:
    """(temperature, top_p) with OpenAI's top_p 0 read as greedy decoding (the smallest nucleus
    holds only the likeliest token); the API and chat_cli both take it so."""
    return (0.0, None) if top_p == 0 else (temperature, top_p)


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row of x (B, V), as (B, 1). Over a whole vocabulary row
    torch.topk runs a multi-pass select that costs ~130 us per call on the H100; a top-k of
    each 512-wide chunk (many small slices, one launch) and then of those B x k candidates is
    exact (every global top-k value is in its chunk's top k) and cheaper."""
    B, V = x.shape
    if k > TOPK_CHUNK or V <= 4 * TOPK_CHUNK:
        return torch.topk(x, k, dim=-1).values[:, -1:]
    pad = -V % TOPK_CHUNK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    part = torch.topk(x.view(B, -1, TOPK_CHUNK), k, dim=-1).values
    return torch.topk(part.reshape(B, -1), k, dim=-1).values[:, -1:]


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator) -> torch.Tensor:
    """One token id per row of `logits` (B, V), as a (B,) long tensor (the torch sampler).
    `generator`: a torch.Generator (or None) for every row, or a sequence of one per row."""
    if is_greedy(temperature):
        return greedy_tokens(logits)
    logits = nan_as_masked(logits.float())
    # top-k on the raw logits (dividing by T > 0 keeps their order; the Triton sampler does the same)
    if top_k is not None and top_k < logits.size(-1):
        logits = logits.masked_fill(logits < kth_largest(logits, top_k), float("-inf"))
    logits = logits / min(temperature, MAX_TEMPERATURE)
    noise = _exponential_noise(logits, generator)
    if top_p is None:
        return (logits - noise.log()).argmax(dim=-1)  # p_i / E_i, in log space (softmax's norm drops out)
    probs = torch.softmax(logits, dim=-1)
    return (nucleus(probs, top_p) / noise).argmax(dim=-1)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` (B, V) with the tokens outside the top-p nucleus zeroed: a token stays when the
    tokens strictly more likely than it hold less than top_p. The first-ranked token always stays,
    and tokens of equal probability stay or go together: cutting by sort position dropped part of
    a tie group by token id (bf16 logits tie often), a bias toward low ids that the Triton sampler,
    which cuts by value, did not have."""
    ranked = torch.sort(probs, dim=-1, descending=True).values
    # mass ranked above each position: an exclusive cumsum, non-decreasing (cumsum - p was not,
    # in float32, so the count below could skip a position)
    above = torch.nn.functional.pad(ranked.cumsum(dim=-1)[..., :-1], (1, 0))
    # clamp: a top_p below float32's smallest subnormal (~1.4e-45) compares as 0 and kept nothing
    # (an all-zero row drew token 0)
    kept = (above < top_p).sum(dim=-1, keepdim=True).clamp_min_(1)
    return probs.masked_fill(probs < ranked.gather(-1, kept - 1), 0.0)


def resolve_sampler(request: str, device: torch.device, vocab_size: int | None = None) -> str:
    """torch | triton for a sampler `request` (auto|torch|triton) on `device` with logits of
    `vocab_size` (None: not known yet); raises for a request that cannot be met, naming what can."""
    if request not in SAMPLER_BACKENDS:
        raise ValueError(f"sampler: got {request!r}; accepted: {'|'.join(SAMPLER_BACKENDS)}")
    if request == "torch" or (request == "auto" and device.type != "cuda"):
        return "torch"
    if device.type != "cuda":
        raise ValueError(f"sampler: 'triton' needs a CUDA device, the model is on {device.type}; "
                         "accepted here: auto|torch")
    try:
        from nanochat.triton_sample import MAX_TRITON_VOCAB
    except ImportError as e:
        if request == "triton":
            raise ValueError(f"sampler: 'triton' needs Triton ({e}); accepted here: auto|torch") from e
        return "torch"
    if vocab_size is not None and vocab_size > MAX_TRITON_VOCAB:
        if request == "triton":
            raise ValueError(f"sampler: 'triton' holds a row in registers, up to {MAX_TRITON_VOCAB} tokens; "
                             f"this vocabulary has {vocab_size}; accepted here: auto|torch")
        return "torch"
    return "triton"


class Sampler:
    """The sampler of one generation: `sampler(logits, position)` -> (B,) long token ids for the
    tokens that will sit at `position`. `backend`: auto|torch|triton (resolve_sampler); with auto,
    logits wider than the Triton kernel's limit are drawn by torch, with triton they raise.
    Temperatures below GREEDY_BELOW and top-k 1 are greedy (the argmax, ties to the lowest id)."""

    def __init__(self, device: torch.device, temperature: float, top_k: int | None, top_p: float | None,
                 seed: int, backend: str = "auto"):
        self.device = torch.device(device)
        self.request = backend
        self.backend = resolve_sampler(backend, self.device)
        # top-k 1 is greedy decoding: as a race it drew any of the tokens tied for the top logit
        # (bf16 logits tie often), so the answer depended on the seed; both backends keep ties
        self.temperature = 0.0 if is_greedy(temperature) or top_k == 1 else temperature
        self.top_k, self.top_p, self.seed = top_k, top_p, seed
        self.generators: list = []   # the torch sampler's, one per row (_row_generators, row_generator)
        self._max_vocab, self._triton = 0, None
        if self.backend == "triton":  # imported once here, not per token
            from nanochat.triton_sample import MAX_TRITON_VOCAB, sample_triton

            self._triton = sample_triton
            self._max_vocab = MAX_TRITON_VOCAB if backend == "auto" else float("inf")  # triton: raises

    def fusable(self, vocab_size: int) -> bool:
        """Whether this sampler's draws over `vocab_size` logits can share one sample_triton
        launch with other requests' (row_draws): the Triton kernel, not greedy."""
        return self._triton is not None and vocab_size <= self._max_vocab and self.temperature > 0

    def warmup(self, vocab_size: int) -> None:
        """Compile the Triton kernels now (~1 s), not in a first request; torch needs nothing. The
        warm-up draw is at top-k 1, top-p 0.5 (the two-stage top-k path and the nucleus cut; k and
        p are not specialised on) whatever this sampler's settings: a greedy one compiles nothing."""
        if self._triton is not None and vocab_size <= self._max_vocab:
            self._triton(torch.zeros(1, vocab_size, device=self.device), 1.0, 1, 0.5, self.seed, 0)

    def __call__(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        if self._triton is not None and logits.size(-1) <= self._max_vocab:
            return self._triton(logits, self.temperature, self.top_k, self.top_p, self.seed, position)
        generators = None if self.temperature == 0 else self._row_generators(logits.size(0))
        return sample_next(logits, self.temperature, self.top_k, self.top_p, generators)

    def _row_generators(self, rows: int) -> list:
        """The first `rows` per-row generators, made on first use (greedy draws need none). On
        CUDA that is one noise launch per row instead of one per step: the torch sampler runs
        there only for vocabularies past the Triton kernel's or when asked for."""
        while len(self.generators) < rows:
            r = len(self.generators)
            # rows >= 1 are keyed by a splitmix of the seed, whose low 32 bits (all a CPU generator
            # reads) depend on all 64 of the seed's: a plain generator, so they draw what they drew;
            # row 0's key is the seed itself (row_generator: both halves past 2**32 on the CPU)
            key = row_seed(self.seed, r)
            self.generators.append(row_generator(self.device, key) if r == 0
                                   else torch.Generator(device=self.device).manual_seed(key))
        return self.generators[:rows]
