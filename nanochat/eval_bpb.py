"""Validation bits per byte, the same float on any number of ranks (base_train's and chat_train's
periodic evaluation, base_eval): every rank reads the one stream a single process reads
(eval_loader: rank 0 of 1), EvalBatches deals its first N batches to the ranks, and evaluate_bpb
sums every batch's float64 (nats, bytes) exactly (math.fsum of the gathered rows), so which rank
scored which batch cannot change the result. EvalSet keeps a run's periodic batches after its first
evaluation: the stream is read (tokenized, packed) once per run, not at every evaluation on every
rank.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from nanochat.flags import require_int


def eval_loader(tokenizer, batch_size: int, seq_len: int, split: str, *, device, data_dir=None,
                source: str = "auto"):
    """One finite pass over `split` of the pretraining shards (repeat=False: an --eval-tokens past its
    end scores each token once; the padded tail of the last batch has targets -1, which evaluate_bpb
    skips), read whole on every rank as one process reads it (rank 0 of 1): EvalBatches deals its
    batches. Constructing it opens and checks the shards (MissingDataError); no batch is read yet."""
    from nanochat.dataloader import DataLoader

    return DataLoader(tokenizer, batch_size, seq_len, split, device=device, data_dir=data_dir, rank=0, world_size=1,
                      repeat=False, source=source)


class EvalBatches:
    """The first `batches` micro-batches of `stream`, dealt to the ranks: rank r of W scores batches
    r, r+W, ... (distributed.StridedMicroBatches). Every rank reads the same stream (a loader of
    rank 0 of 1), so the ranks score the batches one process scores and evaluate_bpb's exact sum is
    the same float on any number of ranks (a loader of each rank's own documents packed other rows,
    and a per-rank batch count scored more tokens on more ranks). `steps`: this rank's most;
    `tokens()`: target tokens scored on all ranks (a collective); `seen`: the last batch read (any
    rank's), for evaluate_bpb's unscored forward on a rank that has none of its own."""

    def __init__(self, stream: Iterable, batches: int, rt):
        from nanochat.distributed import StridedMicroBatches

        require_int(batches, "eval batches", 1)
        self.rt, self.steps, self.seen = rt, -(-batches // rt.world_size), None
        self._count = torch.zeros((), dtype=torch.int64, device=rt.device)   # no sync per batch
        self._mine = StridedMicroBatches(self._read(stream), rt.rank, rt.world_size, limit=batches)

    def _read(self, stream: Iterable):
        for batch in stream:
            self.seen = batch
            yield batch

    def __iter__(self):
        for x, y in self._mine:
            self._count += (y >= 0).sum()
            yield x, y

    def tokens(self) -> int:
        import torch.distributed as dist
        count = self._count.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(count)
        return int(count.item())


class _HostRt:
    """`rt` seen by EvalBatches when EvalSet deals a stream on the host (its token count on the CPU)."""

    def __init__(self, rt):
        self.rank, self.world_size, self.device = rt.rank, rt.world_size, torch.device("cpu")


class EvalSet:
    """A training run's periodic validation batches: the first evaluation reads them (EvalBatches
    over `open_stream()`, best a loader on the CPU: no batch makes a round trip through the GPU;
    then its `close()` if it has one) and keeps this rank's share, and a stand-in
    for a rank with none, in host memory; every later evaluation replays them. A run's val data does
    not change (its shards are fixed at start-up), and reading it again cost every rank the whole
    stream's tokenizing and packing at each evaluation (W times one process's host work)."""

    def __init__(self, open_stream: Callable[[], Iterable], batches: int, rt):
        require_int(batches, "eval batches", 1)
        self._open, self._batches, self.rt = open_stream, batches, rt
        self.steps = -(-batches // rt.world_size)
        self._kept: list | None = None
        self._stand_in = None

    def _fill(self) -> None:
        stream = self._open()
        try:
            dealt = EvalBatches(stream, self._batches, _HostRt(self.rt))
            # on the host, as int32 (8 bytes a token for x and y): a CUDA run holds none of them in GPU
            # memory between evaluations (on GB10's unified memory they share its budget either way)
            self._kept = [(x.to("cpu", torch.int32), y.to("cpu", torch.int32)) for x, y in dealt]
            self._stand_in = None if dealt.seen is None else tuple(t.to("cpu", torch.int32) for t in dealt.seen)
        finally:   # a failed fill too: the loader's reader threads end with it, and the next fill starts over
            if callable(getattr(stream, "close", None)):
                stream.close()

    def _to_device(self, batch):
        return tuple(t.to(self.rt.device).long() for t in batch)

    @property
    def seen(self):
        """evaluate_bpb's stand-in batch (any rank's), on the device."""
        return None if self._stand_in is None else self._to_device(self._stand_in)

    def __iter__(self):
        if self._kept is None:
            self._fill()
        for batch in self._kept:
            yield self._to_device(batch)


@torch.no_grad()
def evaluate_bpb(model, batches: Iterable, steps: int, token_bytes: torch.Tensor) -> float:
    """Validation bits per byte: summed nats of targets that are text (token_bytes > 0, target
    != -1), divided by ln 2 x their UTF-8 byte count. Tokenizer-independent, unlike loss.
    With a process group, over every rank's batches: each batch's float64 (nats, bytes) are
    gathered and summed with math.fsum (the exact sum, rounded once), so which rank scored which
    batch does not change the float (per-rank sums all-reduced rounded in a world-size order).
    Stops early if `batches` runs out; with a process group, only once every rank has run out (a
    finite val pass gives ranks different batch counts): until then a rank that ran out re-runs its
    last batch unscored (one that never had one: `batches.seen`, read for another rank), because an
    FSDP forward all-gathers, and a rank that left the loop would pair its final collective with
    another rank's all-gather."""
    import torch.distributed as dist
    distributed = dist.is_available() and dist.is_initialized()
    device = token_bytes.device
    sums, rounds = [], 0   # this rank's (nats, bytes) per batch, on the device; the loop's agreed steps
    it, last = iter(batches), None
    for _ in range(steps):
        batch = next(it, None)
        if distributed:   # one tiny collective per eval batch: every rank takes the same number of steps
            have = torch.tensor(int(batch is not None), device=device)
            dist.all_reduce(have, op=dist.ReduceOp.MAX)
            if not have.item():
                break
            rounds += 1
            if batch is None:
                stand_in = last if last is not None else getattr(batches, "seen", None)
                if stand_in is not None:
                    model(*stand_in, loss_reduction="none")   # the forward's collectives only; not scored
                continue
        elif batch is None:
            break
        x, y = last = batch
        loss = model(x, y, loss_reduction="none").reshape(-1).double()
        y = y.reshape(-1)
        tb = torch.where(y >= 0, token_bytes[y.clamp(min=0)], torch.zeros_like(y)).to(torch.float64)
        sums.append(torch.stack(((loss * (tb > 0)).sum(), tb.sum())))
    nats, nbytes = _exact_sums(sums, rounds if distributed else len(sums), device)
    if nbytes == 0:
        raise ValueError("evaluate_bpb: the validation batches held no text bytes (empty val split?)")
    return nats / (math.log(2) * nbytes)


def _exact_sums(sums: list, rows: int, device) -> tuple[float, float]:
    """math.fsum of the (nats, bytes) rows of every rank (this rank's alone without a process group).
    `rows` is the same on every rank (evaluate_bpb's agreed steps): a rank's table is padded to it
    with zero rows, which add nothing, so one all_gather of equal shapes collects them."""
    import torch.distributed as dist
    table = torch.zeros(rows, 2, dtype=torch.float64, device=device)
    if sums:
        table[:len(sums)] = torch.stack(sums)
    if rows and dist.is_available() and dist.is_initialized():
        parts = [torch.empty_like(table) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, table)
        table = torch.cat(parts)
    nats, nbytes = table.T.tolist()
    return math.fsum(nats), math.fsum(nbytes)
