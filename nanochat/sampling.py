"""Drawing the next token from logits: temperature, top-k, top-p and the draw itself.

One distribution, two implementations: softmax(logits / T) restricted to the top-k logits, then
to the smallest prefix of those, by probability, that covers top_p; T = 0 is greedy.
  * `sample_next` (torch, any device): the exponential race argmax_i p_i / E_i, E_i ~ Exp(1)
    i.i.d., which picks i with probability p_i exactly and, unlike torch.multinomial
    (pytorch/pytorch#108968), never synchronises with the host. Noise from a torch.Generator,
    or one per row (what `Sampler` passes: row r's is seeded `row_seed(seed, r)`).
  * `triton_sample.sample_triton` (CUDA, vocabularies up to 32768): the same race in one Triton
    launch per step, three with top-k's two-stage path (~8 torch kernels otherwise), noise
    hashed from (seed, position, row, token).
`Sampler` is what the Engine holds per generation; `backend` auto takes the Triton kernel on
CUDA (where Triton imports and the vocabulary fits) and torch elsewhere. Either way a generation
is reproducible from its seed, and a sample's noise does not depend on how many samples are drawn
beside it: sample 0 of `num_samples=4` is the `num_samples=1` answer up to the batched model
step's float rounding (Triton: the noise hashes the row; torch: a generator per row, where one
generator shared by the rows gave row 0 other noise as soon as a second row took its share).
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
    """The torch generator seed of sample `row` of a generation seeded `seed`: `seed` itself for
    row 0 (a one-sample generation draws what it always drew), a splitmix64 mix of (seed, row)
    for the others, so neighbouring seeds' rows do not share streams."""
    if row == 0:
        return seed
    x = (seed + row * 0x9E3779B97F4A7C15) & MAX_SEED
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MAX_SEED
    return x ^ (x >> 31)


def _exponential_noise(logits: torch.Tensor, generator) -> torch.Tensor:
    """Exp(1) noise shaped like `logits` (B, V): from one generator, or row r from `generator[r]`."""
    noise = torch.empty_like(logits)
    if generator is None or isinstance(generator, torch.Generator):
        noise.exponential_(generator=generator)
    else:
        if len(generator) < noise.size(0):
            raise ValueError(f"sample_next: {len(generator)} generators for {noise.size(0)} rows")
        for row, gen in zip(noise, generator):
            row.exponential_(generator=gen)
    # E >= the smallest normal float: log(0) would turn a masked -inf logit into nan
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


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
        return logits.argmax(dim=-1)
    logits = logits.float()
    # top-k on the raw logits (dividing by T > 0 keeps their order; the Triton sampler does the same)
    if top_k is not None and top_k < logits.size(-1):
        logits = logits.masked_fill(logits < kth_largest(logits, top_k), float("-inf"))
    logits = logits / min(temperature, MAX_TEMPERATURE)
    noise = _exponential_noise(logits, generator)
    if top_p is None:
        return (logits - noise.log()).argmax(dim=-1)  # p_i / E_i, in log space (softmax's norm drops out)
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    # drop a token when the tokens ranked above it already cover top_p (the first always stays)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    # the first always stays, explicitly: a top_p below float32's smallest subnormal (~1.4e-45)
    # compares as 0, which dropped it too, and the all-zero row then drew token 0
    drop[..., 0] = False
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return (probs / noise).argmax(dim=-1)


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
        self.generators: list[torch.Generator] = []   # the torch sampler's, one per row (_row_generators)
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

    def _row_generators(self, rows: int) -> list[torch.Generator]:
        """The first `rows` per-row generators, made on first use (greedy draws need none). On
        CUDA that is one noise launch per row instead of one per step: the torch sampler runs
        there only for vocabularies past the Triton kernel's or when asked for."""
        while len(self.generators) < rows:
            seed = row_seed(self.seed, len(self.generators))
            self.generators.append(torch.Generator(device=self.device).manual_seed(seed))
        return self.generators[:rows]
