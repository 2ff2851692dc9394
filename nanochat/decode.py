"""Static-shape decode steps and their CUDA graphs: the Engine's decode="graphs" (and "static") path.

Why: a one-token decode step of a d20 model is ~20 layers x a dozen small kernels; launched from
Python (eager, or torch.compile with its guards) the step is bound by CPU launch overhead, not by
reading the weights. A CUDA graph replays the whole step with one launch, but it needs every shape
and every address fixed. So a `StaticDecoder` (one per batch size) owns:

  * a persistent KVCache covering the model's whole context (its addresses never change);
  * one device input buffer `inputs` = [token of each row..., position], refilled by one
    host->device copy per step (the position is a device tensor, never a Python int);
  * per length bucket (`bucket_length`: the filled length rounded up to a multiple of `bucket`,
    capped at the cache length) a `StaticKV` view whose attention reads exactly that many cache
    slots under a causal + window mask computed from the position, and one captured graph.

Two ways to feed a step: `step(column, position)` copies host tokens in (prefill hand-over,
tool-forced tokens), `step_sampled(tensor, position)` takes the sampled tokens straight from the
device, so the Engine queues step t+1 before it has read token t on the host (`fetch` waits for
that copy alone) and the per-token Python overlaps the GPU instead of idling it.

With `per_row=True` (continuous batching, nanochat/batching.py) the buffer holds a position per
row, [tokens..., positions...], and `step(column, positions)` takes one per row: rows sit at
different depths of their own conversations, and the bucket is the one of the deepest row.

Within a bucket every step replays the same graph; crossing a bucket boundary captures (once) the
next bucket's graph. The step that is captured is `step_model(ids, kv_cache=StaticKV)`:
`torch.compile(model, dynamic=True)` ("compiled": fused kernels; the length and batch are
symbolic, so it compiles about twice, for batch 1 and batch > 1) or the plain model ("eager").
Capture follows the CUDA-graph recipe: warm-up runs on a side stream (compilation, cuBLAS and
allocator warm-up happen there), then capture into a memory pool shared by all graphs of the engine
(graphs never run concurrently and each keeps its own output buffer alive). decode="static" runs
the same step without capture, on any device: that is what the CPU tests compare with eager
decoding and full recomputation.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from nanochat.attention import KVCache, StaticKV

DEFAULT_BUCKET = 256
GRAPH_WARMUP_RUNS = 2  # side-stream runs before a capture: the first may compile, the second settles


def bucket_length(num_tokens: int, cache_len: int, bucket: int) -> int:
    """The attention length a step with `num_tokens` filled slots reads: rounded up to a multiple
    of `bucket`, capped at the cache length."""
    assert 1 <= num_tokens <= cache_len, f"{num_tokens} tokens in a cache of {cache_len}"
    return min(cache_len, -(-num_tokens // bucket) * bucket)


class StaticDecoder:
    """Fixed-shape decode steps for `cache.batch_size` rows over the persistent `cache`.

    `step(column, position)` writes the k/v of `column` (one token per row) at `position` and
    returns the logits (B, V) for the next token. With `use_graphs` the returned tensor is the
    graph's static output buffer: it is overwritten by the next step, so consume it first.
    """

    def __init__(self, cache: KVCache, step_model, *, bucket: int = DEFAULT_BUCKET,
                 use_graphs: bool = False, pool=None, per_row: bool = False):
        if bucket < 1:
            raise ValueError(f"decode_bucket: got {bucket}; accepted: an integer >= 1")
        self.cache, self.step_model, self.bucket = cache, step_model, bucket
        self.use_graphs, self.pool = use_graphs, pool
        self.device = cache.k[0].device
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"decode: 'graphs' needs a CUDA device, the cache is on {self.device}")
        B = cache.batch_size
        self.per_row = bool(per_row) and B > 1   # batch 1: one position either way
        n = B + (B if self.per_row else 1)
        self.inputs = torch.zeros(n, dtype=torch.long, device=self.device)  # tokens..., position(s)
        self.ids, self.pos = self.inputs[:B].view(B, 1), self.inputs[B:]
        # Pinned host staging buffer: the per-step copy is asynchronous; `_copied` guards reuse.
        self._host = torch.zeros(n, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        # Pinned host landing buffer for the sampled tokens (`fetch`), its ready event, and the side
        # stream its copies run on.
        self._sampled_host = torch.zeros(B, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._fetched = torch.cuda.Event() if self.device.type == "cuda" else None
        self._sampled_ready = torch.cuda.Event() if self.device.type == "cuda" else None
        self._fetch_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._key_pos: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captures = 0   # graphs captured so far (one per bucket used)
        self.capture_seconds = 0.0  # time spent capturing (and compiling in the warm-up runs)
        self.busy = False   # held by a live generation (Engine hands a busy decoder to no one else)

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    def lengths(self) -> list[int]:
        """Every bucket length this decoder can use."""
        return sorted({bucket_length(n, self.cache.seq_len, self.bucket)
                       for n in range(1, self.cache.seq_len + 1, self.bucket)} | {self.cache.seq_len})

    def step(self, column: Sequence[int], position: int | Sequence[int]) -> torch.Tensor:
        """`position`: an int for every row, or (per_row decoders) a sequence with one per row."""
        if len(column) != self.batch_size:
            raise ValueError(f"decode step: got {len(column)} tokens for a batch of {self.batch_size}")
        if isinstance(position, int):
            positions = [position] * (self.batch_size if self.per_row else 1)
        elif len(position) == self.pos.numel():   # one per row, or batch 1's one
            positions = [int(p) for p in position]
            self._check_position(min(positions))
        else:
            raise ValueError(f"decode step: {len(position)} positions for a batch of {self.batch_size} "
                             "(a position per row needs a per_row decoder)")
        length = self._check_position(max(positions))
        self._set_inputs(column, positions)
        return self._launch(length)

    def step_rows(self, sampled: torch.Tensor, rows: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """`step` for the batcher's lookahead: `sampled` (R,) tokens on the device for cache rows
        `rows` (R,) (a device long tensor), token 0 for the other rows, `positions` one per row
        (host ints; batch 1: one). Queued before the host has read the samples."""
        if len(positions) != self.pos.numel():
            raise ValueError(f"decode step: {len(positions)} positions for a batch of {self.batch_size}")
        self._check_position(min(positions))
        length = self._check_position(max(positions))
        self._set_inputs([0] * self.batch_size, positions)
        self.inputs[:self.batch_size].index_copy_(0, rows, sampled.view(-1))   # after the copy, same stream
        return self._launch(length)

    def step_sampled(self, sampled: torch.Tensor, position: int) -> torch.Tensor:
        """`step` fed from a device tensor of sampled tokens (B,): no host round trip, so it can be
        queued before the host has read the samples (the Engine's one-step lookahead)."""
        if self.per_row:
            raise ValueError("decode step_sampled: a per_row decoder takes host positions (step)")
        length = self._check_position(position)
        # one kernel writes tokens and position (from a device table): a device copy and a fill
        # were two stream ops with ~2.5 us gaps each (H100 profile)
        positions = self._key_positions(self.cache.seq_len)  # the device table 0..seq_len-1
        torch.cat((sampled.view(self.batch_size), positions[position:position + 1]), out=self.inputs)
        return self._launch(length)

    def _check_position(self, position: int) -> int:
        """The bucket length a step at `position` reads; raises past the cache end."""
        if not 0 <= position < self.cache.seq_len:
            raise ValueError(f"decode step: position {position} is past the cache end "
                             f"({self.cache.seq_len} tokens); the context is full")
        return bucket_length(position + 1, self.cache.seq_len, self.bucket)

    def _launch(self, length: int) -> torch.Tensor:
        """Run the step on the inputs already in place: directly, or by replaying its graph."""
        if not self.use_graphs:
            return self._run(length)
        graph, logits = self.graphs.get(length) or self.capture(length)
        graph.replay()
        return logits

    def fetch(self, sampled: torch.Tensor):
        """Start copying `sampled` (B,) to the host; returns a function that waits for exactly that
        copy (not for work queued after it) and gives the tokens as a list. The copy runs on a
        side stream: on the compute stream the next step would wait for the copy engine first
        (batch-1 d20 on the H100: ~18 us per token of gaps around the copy, torch profiler)."""
        host = self._sampled_host[:sampled.numel()]   # the batcher fetches its live rows only
        if self._fetched is None:
            host.copy_(sampled)
            return host.tolist
        self._sampled_ready.record()
        self._fetch_stream.wait_event(self._sampled_ready)
        with torch.cuda.stream(self._fetch_stream):
            host.copy_(sampled, non_blocking=True)
            self._fetched.record()
        sampled.record_stream(self._fetch_stream)  # its memory is not reused before the copy read it

        def wait() -> list[int]:
            self._fetched.synchronize()
            return host.tolist()
        return wait

    def _set_inputs(self, column: Sequence[int], positions: Sequence[int]) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the staging buffer
        B = self.batch_size
        self._host_np[:B] = column
        self._host_np[B:] = positions
        self.inputs.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _key_positions(self, length: int) -> torch.Tensor:
        key_pos = self._key_pos.get(length)
        if key_pos is None:
            key_pos = self._key_pos[length] = torch.arange(length, device=self.device)
        return key_pos

    def _run(self, length: int) -> torch.Tensor:
        kv = StaticKV(self.cache, self.pos, self._key_positions(length))
        return self.step_model(self.ids, kv_cache=kv)[:, -1, :]

    def capture(self, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the step for bucket `length` (idempotent). The warm-up runs execute the step on
        the current inputs: they rewrite this position's k/v with the same values."""
        if length in self.graphs:
            return self.graphs[length]
        t0 = time.perf_counter()
        self._key_positions(length)  # allocated outside the capture
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_RUNS):
                self._run(length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run(length)
        self.graphs[length] = (graph, logits)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        return graph, logits
