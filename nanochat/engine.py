"""Inference: batched sampling from a GPT with a preallocated KV cache, stop tokens and the
calculator tool.

    engine = Engine(model, tokenizer)
    for tokens, masks in engine.generate(prompt_ids, num_samples=4, temperature=0.8, seed=1):
        ...   # one token per sample per step; mask 1 = sampled, 0 = forced by the tool

How a call runs: the prompt is prefilled once with batch 1, the cache is then replicated into
`num_samples` rows (`KVCache.prefill_from`) and every decode step feeds one token per row.
Sampling (temperature / top-k / top-p, nanochat/sampling.py) is seeded per call, so a call is
reproducible, and sample i draws with the same noise whatever `num_samples` is (so sample 0 of
four is the one-sample answer, up to the batched step's float rounding); temperature 0 (or top-k
1) is greedy. On CUDA a step's draw is one Triton launch (three with top-k's two-stage sampler,
nanochat/triton_sample.py).

Tool use: when a row writes `<|python_start|> expr <|python_end|>`, `expr` is evaluated by
`nanochat.calculator` (a whitelisting arithmetic parser, never `eval`) and
`<|output_start|> result <|output_end|>` is forced into that row, one token per step, with mask 0.
A call the calculator refuses gets `<|output_start|>error<|output_end|>` (calculator.REFUSED_OUTPUT,
shown "<<expr=error>>").

A row finishes at its first stop token (default `<|assistant_end|>` and `<|bos|>`); the stop
token is yielded, and after it the row repeats that token with mask 0 until every row is done.

Decode modes (`decode=`, the attribute `decode_mode` says what was chosen):
  * "graphs" (what "auto" picks on CUDA; chat_web and bench_inference use "auto"): fixed-shape
    decode steps replayed as CUDA graphs, one per (batch size, 256-token length bucket), over a
    persistent full-context cache per batch size (nanochat/decode.py says how). The step inside
    the graph is `torch.compile(model, dynamic=True)` (`graph_step="compiled"`) or the plain
    model (`graph_step="eager"`); `graph_step="persistent"` runs batch-1 steps as one persistent
    Triton kernel (nanochat/triton_decode.py; it raises where the model or device cannot run it)
    and other batch sizes compiled; `graph_step="auto"` (the default) picks persistent on the GPUs
    it was measured faster on (H100: +22% batch-1 tok/s) once a one-step probe matches the model,
    else compiled, and `graph_step_note` says which and why. Call `warmup()` at start-up: it
    compiles and captures every bucket for batch 1 and 2, so no request pays for it (a new batch
    size captures on first use).
  * "static": the same fixed-shape step without capture, on any device (tests compare it with
    eager decoding and with full recomputation on CPU). Its step is the plain model (or the
    persistent kernel): only graphs compile theirs, so `graph_step` says "eager" here.
  * "compile": the dynamic-shape `torch.compile(model, dynamic=True)` of the cached forward.
  * "eager" (the default, what "auto" picks elsewhere): the plain model; no compile surprises
    inside training or eval loops.
Static and graphs decoding look one step ahead (`_decode_static`): the sampled tokens feed the
next step on the device and that step is queued before the host reads them, so the per-token
Python overlaps the GPU; a tool-forced token is known a step ahead and written over its row's
sample before that step is queued (`ForcedTokens`; it used to re-run the step, the whole batch).
Measured (H100, d20 bf16, bench_inference; history in CHANGELOG_GB10.md): "graphs" with the
persistent batch-1 step and the Triton sampler, 0.66-0.67 ms per token (1,498-1,511 tok/s);
"compile" 7.16 ms per step plus minutes of recompiles; graph_step="eager" 3.3 ms at batch 1.
Many concurrent requests: nanochat/batching.py decodes them as rows of one step. A model with
int8 weights (nanochat/quantize.py, `--quantize int8`) decodes through every mode, the
persistent step included (it reads the int8 rows and their scales).
The prompt prefill runs the plain model (`_prefill(compiled=True)`, what the continuous batcher
uses under compiled graph steps, runs its dynamic compile instead). If a second generation with
the same batch size runs while the first is still live (two open iterators), the second decodes
eagerly with a private cache instead of sharing the persistent one.
"""

from __future__ import annotations

import contextlib
import sys
from numbers import Integral
from typing import Iterable, Iterator, Sequence

import torch

from nanochat.calculator import tool_output
from nanochat.decode import DEFAULT_BUCKET, StaticDecoder
from nanochat.engine_rows import (ForcedTokens, _check_int, _fits_float, _Row, _stop_ids,  # noqa: F401 (re-exported)
                                  validate_sampling)
from nanochat.sampling import MAX_SEED, Sampler, resolve_sampler
from nanochat.tokenizer import assistant_parts  # noqa: F401  (lives with the chat rendering it inverts)

DECODE_MODES = ("auto", "eager", "compile", "static", "graphs")
GRAPH_STEPS = ("auto", "compiled", "eager", "persistent")
# Compute capabilities where the persistent batch-1 step was measured faster than the compiled
# graph step (H100: 1,067 vs 871 tok/s at d20, CHANGELOG_GB10.md); graph_step="auto" picks it
# only there, "persistent" forces it anywhere it can run.
PERSISTENT_MEASURED_CC = ((9, 0),)
MAX_DECODERS = 4  # persistent caches (one per batch size) kept; least recently used evicted
# How tool calls read as text (GSM8K's own notation, "<<48/2=24>>") in the CLI and the web UI.
TOOL_TEXT = {"<|python_start|>": "<<", "<|python_end|>": "=", "<|output_start|>": "", "<|output_end|>": ">>"}


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class Engine:
    """Sampling from `model` with a KV cache; `tokenizer` supplies special tokens and the tool's
    text encoding. `tokenizer=None` (benchmarks on random weights) disables the tool and the
    default stop tokens. `decode`: auto|eager|compile|static|graphs (module docstring);
    `decode_bucket`: the attention length granularity of static/graphs steps; `graph_step`:
    auto|compiled|eager|persistent, what a static/graphs step runs (persistent: batch 1 as one
    persistent Triton kernel, nanochat/triton_decode.py, other batch sizes compiled; auto:
    persistent where it can run on a GPU it was measured faster on and passes a one-step probe
    against the model, else `graph_fallback`: compiled, or eager for a quick start (chat_cli);
    compiled only under graphs, eager elsewhere; the attribute says what runs, `graph_step_note` why);
    `fused_qkv`: generate inside the model's inference_weights() (one q/k/v matmul per layer;
    False for A/B benchmarks; persistent needs it); `sampler`: auto|torch|triton, how tokens are
    drawn (nanochat/sampling.py; auto: the Triton sampler on CUDA, `sampler_backend`
    says which)."""

    def __init__(self, model, tokenizer=None, *, decode: str = "eager", cache_dtype: torch.dtype | None = None,
                 decode_bucket: int = DEFAULT_BUCKET, graph_step: str = "auto", fused_qkv: bool = True,
                 sampler: str = "auto", graph_fallback: str = "compiled"):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode: got {decode!r}; accepted: {'|'.join(DECODE_MODES)}")
        if graph_step not in GRAPH_STEPS:
            raise ValueError(f"graph_step: got {graph_step!r}; accepted: {'|'.join(GRAPH_STEPS)}")
        if graph_fallback not in ("compiled", "eager"):
            raise ValueError(f"graph_fallback: got {graph_fallback!r}; accepted: compiled|eager")
        _check_int(decode_bucket, "decode_bucket", 1, "an integer >= 1")
        if not isinstance(fused_qkv, bool):   # "off" was truthy: fused, and labelled so
            raise ValueError(f"fused_qkv: got {fused_qkv!r}; accepted: True|False")
        if cache_dtype is not None and not (isinstance(cache_dtype, torch.dtype) and cache_dtype.is_floating_point):
            raise ValueError(f"cache_dtype: got {cache_dtype!r}; accepted: None or a floating-point torch dtype "
                             "(e.g. torch.bfloat16)")
        if graph_step == "persistent" and not fused_qkv:
            raise ValueError("graph_step: 'persistent' reads the fused q/k/v weights; it needs fused_qkv=True")
        self.model = model
        self.tokenizer = tokenizer
        self.device = _model_device(model)
        if decode == "auto":
            decode = "graphs" if self.device.type == "cuda" else "eager"
        if decode == "graphs" and self.device.type != "cuda":
            raise ValueError(f"decode: 'graphs' needs a CUDA device, the model is on {self.device.type}; "
                             "accepted here: auto|eager|compile|static")
        self.decode_mode = decode
        self.sampler = sampler
        self.sampler_backend = resolve_sampler(sampler, self.device, int(model.config.vocab_size))
        self.decode_bucket, self.fused_qkv = decode_bucket, fused_qkv
        self.cache_dtype = cache_dtype or self._default_cache_dtype()
        self.graph_step_auto = graph_step == "auto"
        # what runs where the persistent kernel does not (other batch sizes, a failed probe): the
        # compiled step only inside CUDA graphs; every other mode's static steps run the plain model
        self.other_step = "eager" if decode != "graphs" else graph_fallback if self.graph_step_auto else "compiled"
        self.graph_step, self.graph_step_note = self._resolve_graph_step(graph_step)
        if self.graph_step != "persistent":
            self.other_step = self.graph_step
        self._compiled = None
        self.decoders: dict[int, StaticDecoder] = {}  # batch size -> decoder, least recently used first
        self._graph_pool = None
        if tokenizer is not None:
            sp = tokenizer.encode_special
            self._python_start, self._python_end = sp("<|python_start|>"), sp("<|python_end|>")
            self._output_start, self._output_end = sp("<|output_start|>"), sp("<|output_end|>")
            self.default_stop_tokens = (sp("<|assistant_end|>"), tokenizer.bos_token_id)
        else:
            self._python_start = self._python_end = None
            self.default_stop_tokens = ()

    # ------------------------------------------------------------------ setup helpers

    def _resolve_graph_step(self, request: str) -> tuple[str, str]:
        """(graph step, note): an explicit request as is; auto -> persistent where the batch-1
        kernel can run on this model and device and was measured faster, else other_step."""
        if request == "compiled" and self.decode_mode != "graphs":
            return "eager", (f"graph_step compiled: decode={self.decode_mode} runs its static steps on the plain "
                             "model (only decode='graphs' compiles the step): eager")
        if request == "persistent" and self.decode_mode not in ("static", "graphs"):
            # no static step to run it (it was kept as the attribute, and banners said "persistent")
            return self.other_step, (f"graph_step persistent: decode={self.decode_mode} has no static decode step "
                                     f"(only decode='static' or 'graphs' runs the persistent kernel): "
                                     f"{self.other_step}")
        if request not in ("auto", "persistent") or self.decode_mode not in ("static", "graphs"):
            return (self.other_step if request == "auto" else request), ""
        reason = self._persistent_unsupported()
        if request == "persistent":
            if reason is not None:   # an explicit request refused up front, not at the first answer
                # a RequestError (a ValueError): the scripts print it as one line, not a traceback
                from nanochat.errors import RequestError
                raise RequestError(f"graph_step (--graph-step): 'persistent' cannot run here: {reason}; "
                                   "accepted here: auto|compiled|eager")
            return "persistent", ""
        if reason is None and self.device.type == "cuda":
            cc = torch.cuda.get_device_capability(self.device)
            if cc not in PERSISTENT_MEASURED_CC:
                reason = (f"the persistent step was measured faster only on compute capability 9.0 (H100/H200); "
                          f"this GPU is {cc[0]}.{cc[1]} (graph_step='persistent' forces it)")
        if reason is not None:
            return self.other_step, f"graph_step auto: {self.other_step} ({reason})"
        return "persistent", (f"graph_step auto: persistent batch-1 kernel (nanochat/triton_decode.py), "
                              f"others {self.other_step}")

    def _persistent_unsupported(self) -> str | None:
        """Why the persistent batch-1 step cannot run on this engine's model and device, or None."""
        try:
            from nanochat.triton_decode import unsupported
        except ImportError as e:  # no Triton on this platform
            return f"Triton is not importable ({e})"
        return "fused_qkv is off" if not self.fused_qkv else unsupported(self.model, self.new_cache(1, 1))

    def _persistent_step(self, cache):
        """The persistent batch-1 step over `cache`; under graph_step auto it must first match the
        model's own step at position 0 (a real launch: compile, residency, logits), or the
        engine falls back to other_step and says why (None is returned)."""
        from nanochat.attention import StaticKV
        from nanochat.triton_decode import PersistentDecodeStep

        with self.inference_weights():  # the step keeps the fused q/k/v buffers' addresses
            if not self.graph_step_auto:
                return PersistentDecodeStep(self.model, cache)
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            pos = torch.zeros(1, dtype=torch.long, device=self.device)
            length = min(self.decode_bucket, self.max_seq_len)  # the first bucket, as StaticDecoder uses
            keys = torch.arange(length, device=self.device)
            try:  # slot 0 it writes is overwritten when a prompt is handed over
                step = PersistentDecodeStep(self.model, cache)
                with torch.inference_mode():
                    got = step(ids, kv_cache=StaticKV(cache, pos, keys)).float()
                    want = self.model(ids, kv_cache=StaticKV(self.new_cache(1, length), pos, keys)).float()
                err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
                problem = None if err <= 0.1 else f"its logits differ from the model's by {err:.3g} (relative)"
            except (ValueError, RuntimeError) as e:  # compile, resources, residency
                problem = str(e).splitlines()[0][:200]
        if problem is None:
            return step
        self.graph_step = self.other_step
        self.graph_step_note = (f"graph_step auto: {self.other_step} (the persistent step failed its probe: "
                                f"{problem})")
        # stderr: on stdout the line led `chat_cli -p`'s answer, which stdout is to hold alone
        print(f"engine: {self.graph_step_note}", file=sys.stderr, flush=True)
        return None

    def _default_cache_dtype(self) -> torch.dtype:
        """The dtype the attention layers produce k/v in (GPT.runtime_dtype: bf16 on CUDA, fp32
        elsewhere, or the model's explicit compute dtype)."""
        runtime_dtype = getattr(self.model, "runtime_dtype", None)
        if callable(runtime_dtype):
            return runtime_dtype(self.device)
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + reply: the context the model was trained with."""
        return int(self.model.config.sequence_len)

    def new_cache(self, batch_size: int, seq_len: int):
        """A preallocated KV cache for `batch_size` rows of up to `seq_len` tokens."""
        from nanochat.attention import KVCache

        cfg = self.model.config
        return KVCache(batch_size=batch_size, num_kv_heads=cfg.n_kv_head, seq_len=seq_len,
                       head_dim=cfg.n_embd // cfg.n_head, num_layers=cfg.n_layer,
                       device=self.device, dtype=self.cache_dtype)

    def _decode_model(self):
        """The module that runs dynamic-shape decode steps: the model or its dynamic compile."""
        if self.decode_mode == "eager":
            return self.model
        return self._compiled_model()

    def _compiled_model(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.model, dynamic=True)
        return self._compiled

    def _acquire_decoder(self, batch_size: int) -> StaticDecoder | None:
        """The persistent static decoder for `batch_size`, marked busy; None when this engine does
        not decode statically or that decoder is held by another live generation."""
        if self.decode_mode not in ("static", "graphs"):
            return None
        decoder = self.decoders.pop(batch_size, None)
        if decoder is None:
            idle = [b for b, d in self.decoders.items() if not d.busy]
            if len(self.decoders) >= MAX_DECODERS and idle:
                del self.decoders[idle[0]]  # least recently used: frees its cache and graphs
            decoder = self.new_decoder(self.new_cache(batch_size, self.max_seq_len))
        self.decoders[batch_size] = decoder  # (re)inserted last: most recently used
        if decoder.busy:
            return None
        decoder.busy = True
        return decoder

    def step_at(self, batch_size: int) -> str | None:
        """What a static/graphs step of `batch_size` rows runs: graph_step, except that the persistent
        kernel runs batch 1 only (other batches run other_step); None when this mode has no such step."""
        if self.decode_mode not in ("static", "graphs"):
            return None
        return self.graph_step if self.graph_step != "persistent" or batch_size == 1 else self.other_step

    def new_decoder(self, cache, *, per_row: bool = False) -> StaticDecoder:
        """A static decoder over `cache` running this engine's graph step (the persistent kernel
        at batch 1 when chosen, else other_step), captured as CUDA graphs under decode="graphs"."""
        graphs = self.decode_mode == "graphs"
        if graphs and self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        step_model = None
        if self.graph_step == "persistent" and cache.batch_size == 1:
            step_model = self._persistent_step(cache)  # None: auto fell back to other_step
        if step_model is None:
            step_model = self._compiled_model() if graphs and self.other_step == "compiled" else self.model
        return StaticDecoder(cache, step_model, bucket=self.decode_bucket, use_graphs=graphs,
                             pool=self._graph_pool, per_row=per_row)

    def warmup(self, batch_sizes: Sequence[int] = (1, 2), *, all_buckets: bool = True) -> float:
        """Compile now, not in the first request: batch 1 and >1 (size-1 dimensions get their own
        graph). "graphs" also captures every length bucket of those batch sizes (`all_buckets`;
        False captures only the first, which is what compiles; later buckets then capture on first
        use, ~0.1-1 s each); "compile" with sliding-window layers also runs a position past the
        shortest window (the cache slice changes form there); the Triton sampler compiles too.
        Every mode ends with a short real request per batch size, so the first user request does
        not pay the prefill's one-time initialisation. Returns seconds spent."""
        import time

        t0 = time.perf_counter()
        if self.decode_mode == "graphs":
            with self.on_device():   # the Triton sampler launches on the current device
                Sampler(self.device, 1.0, 1, 0.5, 0, self.sampler_backend).warmup(int(self.model.config.vocab_size))
            with self.on_device(), self.inference_weights(), torch.inference_mode():
                for b in batch_sizes:
                    decoder = self._acquire_decoder(b)
                    if decoder is None:
                        continue
                    try:
                        for length in decoder.lengths()[:None if all_buckets else 1]:
                            decoder.capture(length)
                    finally:
                        decoder.busy = False
        # short real requests: the prefill runs eagerly, and its first run at each attention form
        # (plain causal; past the shortest window, masked) pays cuBLAS / attention kernel loading
        # that the first user request would otherwise see as time to first token (H100, d20,
        # graphs: 1.3 s before this, CHANGELOG_GB10.md); "compile" also compiles there
        # (a 4-token prompt would not fit a context of 4 or less: the shortest that generates then)
        lengths = [min(4, self.max_seq_len - 1)] + [w + 1 for w in set(getattr(self.model, "windows", None) or ())
                         if w is not None and w + 4 < self.max_seq_len]
        self._short_requests(batch_sizes, lengths)
        return time.perf_counter() - t0

    def _short_requests(self, batch_sizes: Sequence[int], prompt_lengths: Sequence[int]) -> None:
        for n in prompt_lengths:
            for b in batch_sizes:
                for _ in self.generate([0] * n, num_samples=b, max_tokens=3, temperature=1.0, stop_tokens=()):
                    pass

    # ------------------------------------------------------------------ the tool state machine

    def _advance(self, row: _Row, sampled: int, stops: frozenset) -> tuple[int, int]:
        """Choose this step's token for one row (forced, repeated stop, or sampled) and update its
        state. Returns (token, mask)."""
        if row.stop_token is not None:
            return row.stop_token, 0
        if row.forced:
            token, mask = row.forced.popleft(), 0
        else:
            token, mask = sampled, 1
        if token in stops:
            row.stop_token = token
        elif self._python_start is None:
            pass
        elif token == self._python_start:
            row.in_python, row.expr = True, []
        elif token == self._python_end and row.in_python:
            row.in_python = False
            # a refused call gets a closed output block too: left open, a model that learned output
            # blocks (midtraining trains on them) writes one itself, a made-up result that streams as
            # "<<expr=7>>" like a real one and that RL then trains on (mask 1). It holds
            # calculator.REFUSED_OUTPUT ("error"): empty, it showed as "<<expr=>>", a result gone missing
            body = self.tokenizer.encode(tool_output(self.tokenizer.decode(row.expr)))
            row.forced.extend([self._output_start, *body, self._output_end])
        elif row.in_python:
            row.expr.append(token)
        return token, mask

    # ------------------------------------------------------------------ generation

    def _check_prompt(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
            raise ValueError("tokens: expected a non-empty list of token ids")
        vocab = int(self.model.config.vocab_size)
        if any(isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab for t in tokens):
            raise ValueError(f"tokens: every id must be an int in 0..{vocab - 1}")
        if len(tokens) >= self.max_seq_len:
            raise ValueError(f"tokens: prompt has {len(tokens)} tokens; the model's context is "
                             f"{self.max_seq_len}, so at most {self.max_seq_len - 1} leave room to generate")
        return [int(t) for t in tokens]

    def generate(self, tokens: Sequence[int], *, num_samples: int = 1, max_tokens: int = 256,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 42, stop_tokens: Iterable[int] | None = None
                 ) -> Iterator[tuple[list[int], list[int]]]:
        """Yield (token per sample, mask per sample) each step; stops when every sample has hit a
        stop token, after `max_tokens` steps, or when the context is full."""
        return self._generate(*self.check_request(tokens, num_samples, max_tokens, temperature, top_k, top_p,
                                                  seed, stop_tokens))

    def check_request(self, tokens, num_samples, max_tokens, temperature, top_k, top_p, seed, stop_tokens):
        """generate's arguments checked and normalised: (tokens, num_samples, max_tokens,
        temperature, top_k, top_p, seed, stops); raises ValueError naming the bad one."""
        tokens = self._check_prompt(tokens)
        num_samples = _check_int(num_samples, "num_samples", 1, "an integer >= 1")
        max_tokens = _check_int(max_tokens, "max_tokens", 1, "an integer >= 1")
        seed = _check_int(seed, "seed", 0, f"an integer in 0..{MAX_SEED}")
        if seed > MAX_SEED:   # here, not at the first token inside the generator (manual_seed's overflow)
            raise ValueError(f"seed: got {seed}; accepted: an integer in 0..{MAX_SEED}")
        temperature, top_k, top_p = validate_sampling(temperature, top_k, top_p)
        stops = frozenset(self.default_stop_tokens if stop_tokens is None else _stop_ids(stop_tokens))
        vocab = int(self.model.config.vocab_size)
        if any(not 0 <= t < vocab for t in stops):   # an id the model never samples: it would never stop
            raise ValueError(f"stop_tokens: got {sorted(stops)}; accepted: token ids in 0..{vocab - 1}")
        return tokens, num_samples, max_tokens, temperature, top_k, top_p, seed, stops

    def inference_weights(self):
        """The model's inference_weights() context (fused q/k/v, see GPT), or a no-op for models
        without one."""
        enter = getattr(self.model, "inference_weights", None) if self.fused_qkv else None
        return enter() if enter is not None else contextlib.nullcontext()

    def on_device(self):
        """The engine's GPU as the thread's current device: Triton launches and CUDA events go to the
        current device, cuda:0 in a new thread, whichever GPU holds the model (a replica on cuda:1)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _generate(self, tokens, num_samples, max_tokens, temperature, top_k, top_p, seed, stops):
        # inference_weights() spans the generator's life (closing it early runs the finally); the
        # device is set around each step only: held across a yield it leaked into the consumer
        with self.inference_weights():
            steps = self._generate_steps(tokens, num_samples, max_tokens, temperature, top_k, top_p, seed, stops)
            try:
                while True:
                    with self.on_device():
                        step = next(steps, None)
                    if step is None:
                        return
                    yield step
            finally:
                steps.close()

    @torch.inference_mode()  # torch wraps generator functions: the mode is on only inside next()
    def _generate_steps(self, tokens, num_samples, max_tokens, temperature, top_k, top_p, seed, stops):
        max_tokens = min(max_tokens, self.max_seq_len - len(tokens))
        sample = Sampler(self.device, temperature, top_k, top_p, seed, self.sampler_backend)
        decoder = self._acquire_decoder(num_samples)
        if decoder is not None:
            try:
                yield from self._decode_static(tokens, decoder, max_tokens, sample, stops)
            finally:
                decoder.busy = False
            return
        logits, step_fn = self._prefill_dynamic(tokens, num_samples, len(tokens) + max_tokens)
        rows = [_Row() for _ in range(num_samples)]
        for step in range(max_tokens):
            column, masks = self._advance_rows(rows, sample(logits, len(tokens) + step).tolist(), stops)
            yield column, masks
            if step == max_tokens - 1 or all(r.stop_token is not None for r in rows):
                return
            logits = step_fn(column)

    def _advance_rows(self, rows, sampled: list[int], stops) -> tuple[list[int], list[int]]:
        column, masks = zip(*(self._advance(r, s, stops) for r, s in zip(rows, sampled)))
        return list(column), list(masks)

    def _decode_static(self, tokens, decoder: StaticDecoder, max_tokens: int, sample, stops):
        """Static/graphs decoding with a one-step lookahead: the sampled tokens feed the next step
        on the device and that step is queued before the host reads them, so the per-token Python
        (tool state machine, stop checks, the consumer of this generator) runs while the GPU
        computes. A tool-forced token replaces its row's sample before the step (ForcedTokens); a
        live row's token that still differs from what the step was fed re-runs it from the host."""
        logits = self._prefill_static(tokens, decoder)
        rows = [_Row() for _ in range(decoder.batch_size)]
        forced = ForcedTokens(self.device, decoder.batch_size)
        position = len(tokens)
        for step in range(max_tokens):
            sampled = forced.apply(sample(logits, position), rows)
            wait = decoder.fetch(sampled)
            last = step == max_tokens - 1
            if not last:
                logits = decoder.step_sampled(sampled, position)   # speculative: fed the samples
            drawn = wait()
            column, masks = self._advance_rows(rows, drawn, stops)
            yield column, masks
            if last or all(r.stop_token is not None for r in rows):
                return
            if any(c != d for c, d, r in zip(column, drawn, rows) if r.stop_token is None):
                logits = decoder.step(column, position)   # not what it was fed: redo this position
            position += 1

    def _prefill(self, tokens, cache, compiled: bool = False):
        """The prompt through the plain model (or with `compiled` its dynamic compile) with batch 1
        -> last-position logits (1, V); the other positions get none (GPT.forward's logits_at)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        last = torch.tensor([len(tokens) - 1], dtype=torch.long, device=self.device)
        model = self._compiled_model() if compiled else self.model
        return model(ids, kv_cache=cache, logits_at=last)[:, -1, :]

    def prefill(self, tokens: Sequence[int]):
        """The prompt prefill alone, as generation runs it (call it inside inference_weights() and
        inference mode): (logits (1, V) for the next token, a prompt-sized cache holding it)."""
        tokens = self._check_prompt(tokens)
        cache = self.new_cache(1, len(tokens))
        return self._prefill(tokens, cache), cache

    def _prefill_dynamic(self, tokens, num_samples, cache_len):
        """Prefill a private cache (copied into every sample's row); decode steps over it."""
        prefill_cache = self.new_cache(1, cache_len)
        logits = self._prefill(tokens, prefill_cache)
        if num_samples == 1:
            cache = prefill_cache
        else:
            cache = self.new_cache(num_samples, cache_len)
            cache.prefill_from(prefill_cache)
            del prefill_cache
            logits = logits.expand(num_samples, -1)
        model = self._decode_model() if self.decode_mode in ("compile", "eager") else self.model

        def step(column: list[int]) -> torch.Tensor:
            ids = torch.tensor(column, dtype=torch.long, device=self.device).view(-1, 1)
            return model(ids, kv_cache=cache)[:, -1, :]

        return logits, step

    def _prefill_static(self, tokens, decoder: StaticDecoder) -> torch.Tensor:
        """Prefill a prompt-sized cache and copy it into the decoder's persistent cache; returns
        the last-position logits expanded to the decoder's batch."""
        prefill_cache = self.new_cache(1, len(tokens))
        logits = self._prefill(tokens, prefill_cache)
        decoder.cache.prefill_from(prefill_cache)
        del prefill_cache
        return logits.expand(decoder.batch_size, -1)

    def generate_batch(self, tokens: Sequence[int], **kw) -> tuple[list[list[int]], list[list[int]]]:
        """Run `generate` to the end. Returns, per sample, the prompt followed by the generated
        tokens (stop token excluded) and the matching masks (0 for the prompt)."""
        prompt = self._check_prompt(tokens)
        if kw.get("stop_tokens") is not None:   # read once: an iterator read here would reach generate empty
            kw["stop_tokens"] = _stop_ids(kw["stop_tokens"])
        steps = self.generate(prompt, **kw)   # checks every argument first (num_samples "2" was a TypeError)
        num_samples = kw.get("num_samples", 1)
        results = [list(prompt) for _ in range(num_samples)]
        masks = [[0] * len(prompt) for _ in range(num_samples)]
        done = [False] * num_samples
        stops = frozenset(self.default_stop_tokens if kw.get("stop_tokens") is None else kw["stop_tokens"])
        for column, mask_column in steps:
            for i, (token, mask) in enumerate(zip(column, mask_column)):
                if done[i]:
                    continue
                if token in stops:
                    done[i] = True
                    continue
                results[i].append(token)
                masks[i].append(mask)
        return results, masks
