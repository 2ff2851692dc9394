"""Continuous batching: the live generations of many callers share one decode step (chat_web).

    batched = BatchedEngine(engine, slots=8)
    batched.warmup()
    for column, masks in batched.generate(prompt_ids, temperature=0.8, seed=1):   # from any thread
        ...

Why: `Engine.generate` decodes one request at a time, and a decode step reads every weight
whatever its batch: a d20 step on an H100 costs ~0.66 ms at batch 1 and ~1.2 ms at batch 8
(CHANGELOG_GB10.md), so eight conversations decoded together get several times the tokens per
second of eight decoded in turn. `generate` keeps Engine.generate's contract (same arguments and
checks, the same (column, masks) steps, the tool and stop tokens) while one scheduler thread runs
every live request as rows of one step:

  * Slots: one KV cache of `slots` rows over the model's whole context, shared by decoders of
    batch 1, 2, 4, ..., slots (views of its first rows, `KVCache.rows`). Each is a
    per-row-position StaticDecoder (nanochat/decode.py; CUDA graphs under decode="graphs"), so
    every row decodes at its own position. A step runs the smallest decoder that covers the
    highest occupied slot: a lone request keeps the batch-1 step (on an H100 the persistent
    kernel). When rows finish, the highest live rows move down into the free slots
    (`KVCache.copy_row`, only when that shrinks the step).
  * Admission: FIFO; a request waits until `num_samples` slots are free (a head needing more
    slots than are free holds back smaller requests behind it: no starvation of large `n`; a long
    request holds only its own rows, so short ones keep flowing through the others). Between two decode
    steps its prompt is prefilled alone (batch 1) and copied into its slots; the other rows pause
    for that prefill (no chunked prefill). Where the engine's graph steps are compiled the
    prefill is the model's dynamic compile too: an eager d20 prefill is host-bound, 20-26 ms for
    300-2000 tokens on an H100, against 4.4-9.9 ms compiled (two graphs: prompts up to and past
    the shortest window; no recompile per length). It is compiled and run only in the scheduler
    thread: a compiled prefill warmed up in one thread recompiled (~30-45 s) on its first call
    from another (seen on the H100 through Engine.generate; not pinned down).
  * Sampling: each request keeps its own Sampler (seed, temperature, top-k, top-p) over its own
    rows' logits, so its draws do not depend on what else runs; only the batched step's float
    roundings can differ from a lone run.
  * Cancellation: `generate` returns a `RequestStream`; its `cancel()` (any thread, e.g. the
    server's event loop while the consumer thread is blocked waiting for a token) or `close()`
    ends the consumer's iteration at once, takes a queued request out of the queue, and frees a
    live one's slots at the next admission (before the next step). Errors: an exception in a
    request's prefill is raised in that request's stream alone; one in a decode step in every
    request in flight; the scheduler then serves the next ones. If the scheduler thread itself
    dies (e.g. entering inference_weights() fails), every waiting request gets the error and the
    next request starts a new thread, so no caller waits forever.

The scheduler thread holds `engine.inference_weights()` for its life (the fused q/k/v copy
stays allocated), so do not train or call the same Engine's generate from another thread;
`close()` ends it once idle and frees the cache (a later request starts it again). Interpreter
exit cancels whatever is left and waits (up to EXIT_WAIT_S) for the step in flight.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from nanochat.engine import Engine, ForcedTokens, _check_int, _Row
from nanochat.sampling import Sampler

_DONE = object()  # end-of-request marker in a request's output queue
# Schedulers stopped at interpreter exit (_stop_all_at_exit), and how long exit waits for a step in flight
_RUNNING: "weakref.WeakSet[BatchedEngine]" = weakref.WeakSet()
EXIT_WAIT_S = 10.0


@dataclass(eq=False)
class _Request:
    tokens: list[int]
    num_samples: int
    max_tokens: int            # already capped by the context left after the prompt
    sampler: Sampler
    stops: frozenset
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    slots: list[int] = field(default_factory=list)   # cache rows, one per sample
    rows: list[_Row] = field(default_factory=list)   # tool / stop state per sample
    position: int = 0          # where this request's next token goes
    steps: int = 0             # tokens yielded so far
    column: list[int] = field(default_factory=list)  # the tokens the next step feeds
    logits: torch.Tensor | None = None                # (num_samples, V) for the next draw


def _watch_at_exit(batched: "BatchedEngine") -> None:
    """Have interpreter exit stop `batched`'s scheduler (the hook is registered with the first one)."""
    if not _RUNNING:
        atexit.unregister(_stop_all_at_exit)   # once, however often the set empties
        atexit.register(_stop_all_at_exit)
    _RUNNING.add(batched)


def _stop_all_at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for batched in list(_RUNNING):
        batched._stop_at_exit(max(0.0, deadline - time.monotonic()))


def batch_sizes(slots: int) -> list[int]:
    """The decoder batch sizes a BatchedEngine of `slots` rows keeps: powers of two, then slots."""
    sizes, b = [], 1
    while b < slots:
        sizes.append(b)
        b *= 2
    return sizes + [slots]


class RequestStream:
    """What `BatchedEngine.generate` returns: an iterator of (column, masks) steps, as
    Engine.generate's generator, that joins the scheduler's queue at its first `next()`.
    `cancel()` may be called from any thread, also while the consumer is blocked in `next()` (a
    generator cannot be closed from another thread while it runs): the consumer's read returns at
    once and ends the iteration, the request leaves the queue or frees its slots before the next
    step. `close()` is `cancel()`; so is dropping an unfinished stream."""

    def __init__(self, batched: "BatchedEngine", req: _Request):
        self._batched, self._req = batched, req
        self._submitted = self._finished = False

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        if not self._submitted:
            self._submitted = True
            self._batched._submit(self._req)
        item = self._req.out.get()
        if item is _DONE or isinstance(item, BaseException):
            self._finished = True
            self._req.cancelled = True   # a no-op for the scheduler: the request has left it
            if item is _DONE:
                raise StopIteration
            raise item
        return item

    def cancel(self) -> None:
        # the consumer's next read ends the stream even where steps are already queued for it
        # (a consumer slower than the scheduler read them all after a cancel)
        self._finished = True
        if not self._req.cancelled:
            self._batched._cancel(self._req)

    def close(self) -> None:
        self.cancel()

    def __del__(self):
        if self._submitted and not self._finished:
            try:
                self.cancel()
            except Exception:  # noqa: BLE001 - interpreter shutdown: module globals may be gone
                pass


class BatchedEngine:
    """Continuous batching over `engine`'s model (module docstring); `slots` rows at most, which
    also bounds one request's num_samples."""

    def __init__(self, engine: Engine, slots: int = 8):
        self.slots = _check_int(slots, "slots", 1, "an integer >= 1")
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.default_stop_tokens = engine.default_stop_tokens
        self.sizes = batch_sizes(slots)
        self._compiled_prefill = engine.decode_mode == "graphs" and engine.other_step == "compiled"
        self._cache = None
        self._decoders: dict = {}
        self._indices: dict[tuple, torch.Tensor] = {}   # device row indices per slot tuple
        self._table_host = self._table_dev = self._table_copied = None   # _draw_table's buffers
        self._forced = ForcedTokens(engine.device, self.slots)
        self._wake = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._live: list[_Request] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        self.steps = self.rows_stepped = 0   # mean batch = rows_stepped / steps
        self.moves = 0                       # rows moved down by _compact

    # ------------------------------------------------------------------ set-up

    def _ensure_decoders(self) -> None:
        if self._cache is None:
            eng = self.engine
            self._cache = eng.new_cache(self.slots, eng.max_seq_len)
            self._decoders = {b: eng.new_decoder(self._cache.rows(b), per_row=True) for b in self.sizes}

    def warmup(self) -> float:
        """Build the decoders and, under decode="graphs", capture every length bucket of every
        batch size now (compiles too), then run short real requests (prefill's first runs);
        call before serving (the scheduler thread must not be running). Returns seconds."""
        t0 = time.perf_counter()
        eng = self.engine
        if eng.decode_mode == "graphs":
            with self._on_device(), eng.inference_weights(), torch.inference_mode():
                Sampler(eng.device, 1.0, 1, 0.5, 0, eng.sampler_backend).warmup(int(eng.model.config.vocab_size))
                self._ensure_decoders()
                for decoder in self._decoders.values():
                    for length in decoder.lengths():
                        decoder.capture(length)
        # Short requests through the scheduler thread: the prefill (compiled there) before and past
        # the shortest window, and pairs that share one sampler launch (the one-program and the
        # top-k two-stage kernels with per-row draws compile on first use, ~1-2 s each)
        windows = set(getattr(eng.model, "windows", None) or ())
        lengths = [max(1, min(37, eng.max_seq_len - 2))] + [w + 1 for w in windows
                                                            if w is not None and w + 4 < eng.max_seq_len]
        for n in lengths:
            for top_k in (None, 50):
                gens = [self.generate([0] * n, max_tokens=8, top_k=top_k, stop_tokens=(), seed=i)
                        for i in range(min(2, self.slots))]
                for gen in gens:   # submit all before draining any, so they run together
                    next(gen)
                for gen in gens:
                    for _ in gen:
                        pass
        # the counters (chat_web's /stats: steps, rows_stepped, mean_batch) count served requests
        # only: a fresh server reported its warm-up's ~30 steps at a mean batch of ~1.75. The
        # scheduler is idle here (every warm-up request has ended, none other is served yet).
        self.steps = self.rows_stepped = self.moves = 0
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ the callers' side

    def generate(self, tokens, *, num_samples: int = 1, max_tokens: int = 256, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 42, stop_tokens=None):
        """Engine.generate's contract, served by the scheduler: yields (column, masks) per step."""
        tokens, n, max_tokens, temperature, top_k, top_p, seed, stops = self.engine.check_request(
            tokens, num_samples, max_tokens, temperature, top_k, top_p, seed, stop_tokens)
        if n > self.slots:
            raise ValueError(f"num_samples: got {n}; accepted: 1..{self.slots} (the batch slots of this engine)")
        eng = self.engine
        sampler = Sampler(eng.device, temperature, top_k, top_p, seed, eng.sampler_backend)
        req = _Request(tokens, n, min(max_tokens, eng.max_seq_len - len(tokens)), sampler, stops)
        return RequestStream(self, req)

    def _submit(self, req: _Request) -> None:
        with self._wake:
            if req.cancelled:   # cancelled before its first step was asked for
                req.out.put(_DONE)
                return
            if self._thread is None:
                _watch_at_exit(self)
                self._thread = threading.Thread(target=self._loop, name="batching", daemon=True)
                self._thread.start()
            self._pending.append(req)
            self._wake.notify()

    def _cancel(self, req: _Request) -> None:
        """Any thread: a queued request leaves the queue now, a live one at the next admission;
        the consumer's next (or current, blocked) read ends the stream."""
        with self._wake:
            req.cancelled = True
            with contextlib.suppress(ValueError):
                self._pending.remove(req)
            self._wake.notify()
        req.out.put(_DONE)

    @property
    def decode_mode(self) -> str:
        """How the batched steps run: "graphs" (captured) where the engine captures, else "static"."""
        return "graphs" if self.engine.decode_mode == "graphs" else "static"

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def live_rows(self) -> int:
        return sum(r.num_samples for r in self._live)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ the scheduler thread

    def _on_device(self):
        """The engine's GPU as the scheduler thread's current device (Engine.on_device)."""
        return self.engine.on_device()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the scheduler thread once the requests it holds or queues are done, and free the
        cache and decoders (a benchmark builds one BatchedEngine per mode: each kept its thread,
        its inference_weights() and its whole-context cache). A later request starts again."""
        with self._wake:
            thread = self._thread
            if thread is not None:
                self._closing = True
                self._wake.notify()
        if thread is not None:
            thread.join(timeout)
        with self._wake:
            if self._thread is None:
                self._cache, self._decoders = None, {}
                self._indices.clear()

    def _stop_at_exit(self, timeout: float) -> None:
        """Interpreter exit (atexit, main thread): cancel every request and wait for the step in
        flight to end. A daemon thread still inside a step as the interpreter finalizes is killed
        while it frees a tensor, which aborts the process ("terminate called without an active
        exception", exit -6): a script whose last request had just ended died so ~1 run in 8."""
        with self._wake:
            thread, stranded = self._thread, list(self._pending)
            if thread is None:
                return
            self._pending.clear()
            for req in stranded + self._live:   # live ones leave at the next admission
                req.cancelled = True
            self._closing = True
            self._wake.notify()
        for req in stranded:
            req.out.put(_DONE)
        thread.join(timeout)

    def _loop(self) -> None:
        """The scheduler thread. Whatever kills it (an exception outside a step, e.g. entering
        inference_weights() runs out of memory) is raised in every request it holds or that is
        waiting, and the next request starts a new thread: a dead scheduler left them waiting
        forever."""
        me = threading.current_thread()
        try:
            with self._on_device(), torch.inference_mode(), self.engine.inference_weights():
                while self._serve_once():
                    pass
        except BaseException as e:  # noqa: BLE001 - handed to the callers below, never swallowed
            with self._wake:   # under the lock: a request submitted from now on starts a new thread
                stranded = list(self._pending) + self._live if self._thread is me else []
                if self._thread is me:
                    self._pending.clear()
                    self._live, self._thread, self._closing = [], None, False
            for req in stranded:
                req.out.put(e)

    def _serve_once(self) -> bool:
        """Admit and step once; False when close() asked this idle thread to stop."""
        with self._wake:
            while not self._pending and not self._live:
                if self._closing:
                    self._closing, self._thread = False, None
                    return False
                self._wake.wait()
        try:
            self._ensure_decoders()
        except Exception as e:  # no decoders (e.g. out of memory): nobody can be served
            with self._wake:
                failed, self._pending = list(self._pending), deque()
            for req in failed + self._live:
                req.out.put(e)
            self._live.clear()
            return True
        try:
            self._admit()
            if self._live:
                self._step()
        except Exception as e:  # the requests in flight see it; the scheduler goes on
            for req in self._live:
                req.out.put(e)
            self._live.clear()
        return True

    def _admit(self) -> None:
        """Drop cancelled live requests (their slots are free from here on), then prefill the
        queue's head while its slots are free. A failing prefill fails its own request only: it
        wrote its prompt cache and its not-yet-live slots, nothing another request reads."""
        for req in [r for r in self._live if r.cancelled]:
            self._live.remove(req)
            req.out.put(_DONE)
        while True:
            with self._wake:
                used = {s for r in self._live for s in r.slots}
                free = [s for s in range(self.slots) if s not in used]
                if not self._pending or len(free) < self._pending[0].num_samples:
                    return
                req = self._pending.popleft()
            req.slots = free[:req.num_samples]
            try:
                self._prefill(req)
            except Exception as e:  # e.g. out of memory for a long prompt: that request's error
                req.out.put(e)
                continue
            if req.cancelled:   # its client left during the prefill: no step for it
                req.out.put(_DONE)
                continue
            self._live.append(req)

    def _prefill(self, req: _Request) -> None:
        eng = self.engine
        prompt_cache = eng.new_cache(1, len(req.tokens))
        logits = eng._prefill(req.tokens, prompt_cache, compiled=self._compiled_prefill)
        for slot in req.slots:
            self._cache.copy_row(slot, prompt_cache, 0, len(req.tokens))
        req.logits = logits.expand(req.num_samples, -1)
        req.position = len(req.tokens)
        req.rows = [_Row() for _ in range(req.num_samples)]

    def _step(self) -> None:
        """Draw every live request's next tokens and hand them out, with Engine._decode_static's
        one-step lookahead: the decode step that feeds the samples is queued before the host reads
        them, so the per-row Python (tool, stops, queues) overlaps the GPU. A tool-forced token
        replaces its row's sample before that step (ForcedTokens: a re-run per forced token cost
        the whole batch a step); a row whose chosen token still differs makes it re-run."""
        self._compact()   # before the draw: every row's cache then holds [0, position)
        live = self._live
        sampled = self._draw(live)   # reorders live by sampling group
        sampled = self._forced.apply(sampled, [row for req in live for row in req.rows])
        slots = [s for r in live for s in r.slots]
        b = self._size_for(1 + max(slots))
        decoder = self._decoders[b]
        wait = decoder.fetch(sampled)
        positions = [0] * b   # free slots below b: token 0 at slot 0 of their row
        for req in live:
            for slot in req.slots:
                positions[slot] = req.position
        logits = None
        if any(r.steps + 1 < r.max_tokens and not r.cancelled for r in live):
            logits = decoder.step_rows(sampled, self._index(slots), positions)   # speculative
        drawn, i, redo = wait(), 0, False
        for req in list(live):
            mine = drawn[i:i + req.num_samples]
            i += req.num_samples
            column, masks = self.engine._advance_rows(req.rows, mine, req.stops)
            req.steps += 1
            req.column = column
            if not req.cancelled:
                req.out.put((column, masks))
            if req.cancelled or req.steps >= req.max_tokens or all(r.stop_token is not None for r in req.rows):
                live.remove(req)
                req.out.put(_DONE)
            else:
                redo |= any(c != d for c, d, r in zip(column, mine, req.rows) if r.stop_token is None)
        if not live:
            return
        if redo:   # a token the step was not fed: this position again, from the host tokens
            column = [0] * b
            for req in live:
                for slot, token in zip(req.slots, req.column):
                    column[slot] = token
            logits = decoder.step(column, positions)
        for req in live:
            # a view for one row: read (sampled) before the next step can overwrite it
            s = req.slots[0]
            req.logits = logits[s:s + 1] if req.num_samples == 1 else logits.index_select(0, self._index(req.slots))
            req.position += 1
        self.steps += 1
        self.rows_stepped += sum(r.num_samples for r in live)

    def _draw(self, live: list[_Request]) -> torch.Tensor:
        """Every live row's next token on the device. Requests on the Triton sampler with the same
        (temperature, top-k, top-p) are drawn by one launch whose table gives each row its own
        (seed, position, sample index), so the draws equal their own calls' (one launch instead
        of one per request: ~0.15 ms of host time each at d20 on an H100); the others call their
        own sampler. `live` is reordered so that the draws come out in its order."""
        groups: dict = {}
        for req in live:
            s = req.sampler
            fusable = s.fusable(req.logits.size(-1))
            groups.setdefault((s.temperature, s.top_k, s.top_p) if fusable else id(req), []).append(req)
        live[:] = [req for reqs in groups.values() for req in reqs]
        rows = [(req.sampler.seed, req.position, i) for reqs in groups.values() if len(reqs) > 1
                for req in reqs for i in range(req.num_samples)]
        if rows:   # fused groups exist only on the Triton sampler, so Triton is importable
            from nanochat.triton_sample import sample_triton
            table = self._draw_table(rows)
        parts, start = [], 0
        for key, reqs in groups.items():
            if len(reqs) == 1:
                parts.append(reqs[0].sampler(reqs[0].logits, reqs[0].position))
                continue
            n = sum(r.num_samples for r in reqs)
            logits = torch.cat([r.logits for r in reqs])
            parts.append(sample_triton(logits, *key, 0, 0, row_draws=table[start:start + n]))
            start += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _draw_table(self, rows) -> torch.Tensor:
        """row_draw_table(rows) on the device through a pinned buffer (a pageable copy would wait
        for the decode step queued before it)."""
        if self._table_host is None:
            self._table_host = torch.zeros(self.slots, 4, dtype=torch.int64, pin_memory=True)
            self._table_dev = torch.zeros(self.slots, 4, dtype=torch.int64, device=self.engine.device)
            self._table_copied = torch.cuda.Event()
        from nanochat.triton_sample import row_draw_table

        self._table_copied.synchronize()   # the previous copy has read the buffer
        n = len(rows)
        self._table_host[:n] = row_draw_table(rows)
        self._table_dev[:n].copy_(self._table_host[:n], non_blocking=True)
        self._table_copied.record()
        return self._table_dev[:n]

    def _index(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) > 1024:   # slot combinations seen: bounded
                self._indices.clear()
            index = self._indices[key] = torch.tensor(slots, device=self.engine.device)
        return index

    def _size_for(self, rows: int) -> int:
        return next(b for b in self.sizes if b >= rows)

    def _compact(self) -> None:
        """Move the highest live rows into free slots below them when that shrinks the step."""
        occupied = sorted(s for r in self._live for s in r.slots)
        n = len(occupied)
        if self._size_for(occupied[-1] + 1) == self._size_for(n):
            return
        holes = iter(s for s in range(n) if s not in set(occupied))
        moves = {s: next(holes) for s in occupied if s >= n}
        for req in self._live:
            for j, slot in enumerate(req.slots):
                if slot in moves:
                    self._cache.copy_row(moves[slot], self._cache, slot, req.position)
                    req.slots[j] = moves[slot]
                    self.moves += 1
