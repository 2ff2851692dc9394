"""The pretraining dataloader: documents -> BOS-aligned, best-fit packed (inputs, targets) batches.

Packing. Every row holds T+1 tokens and starts at a document start (every document starts with
BOS). A buffer of `buffer_size` tokenized documents is kept full; a row is filled by repeatedly
taking the LARGEST buffered document that fits the remaining space; when none fits, the SHORTEST
one is cropped to fill the row exactly and its tail is dropped (counted in `dropped_fraction`).
A document longer than a whole row can never fit, so it is cropped to T+1 tokens as it enters the
buffer (so the buffer holds at most buffer_size rows of tokens): it then fills a row on its own
instead of lingering until it is cropped at the end of some row (on the offline docs corpus at
T=2048 that drops 32% of tokens instead of 40%; 25% is unavoidable there, since 30% of its
documents are longer than a row).
inputs = row[:-1], targets = row[1:]. Targets are -1 (ignore) only in the padding of the final
batch of a finite pass (`repeat=False`), whose padded inputs are BOS.

Sources. Text shards (parquet, tokenized on the fly with the tokenizer's threaded batch encode) or
binary token shards from `scripts/pretokenize.py` (read with pread; `source="auto"` picks them when
`<data_dir>_tokens/` holds any, and refuses shards made with another tokenizer or from other text
shards than those now in data_dir); nanochat/doc_sources.py reads them. Every shard is checked at
construction, but only those being read stay open, so a split may hold more shards than the
open-file limit.

Checks. Construction opens every shard of the split, so damaged data fails there, before a model
is built: DataError (nanochat/errors.py) for a file that is there but broken (unreadable parquet,
no `text` column, null texts, a corrupt or stale binary shard, another tokenizer, another vocab
size), MissingDataError for a split with no documents for this rank or only empty ones (a
document that is BOS alone) or, for the repeating train split, less than one batch for this rank
(every batch would repeat its documents; text shards, whose token counts only reading shows: at
the end of the first pass). What only reading shows (a row group that does not decompress, token
ids >= the vocab size, a binary document without its BOS: a binary shard's tokens are not read at
construction, see doc_sources.py; empty documents where the footer has no statistics) is the same
error from the first batch that reads it.

Ranks. Documents are dealt rank-strided inside each row group (binary: inside each shard), so
ranks never share a document; every rank reads the same shards.

Prefetch. A background thread packs batches into a bounded queue (pinned memory when the device
is CUDA; the host->device copy is non_blocking), so the trainer does not wait on tokenization.
close() stops it between documents (not after the batch it is packing, which can take seconds).

Exact resume. Each produced batch carries a snapshot of the packer state AFTER it: the epoch, the
cursor after the last document pulled from the stream, the identities (not tokens) of the buffered
documents in insertion order, and the counters. `state_dict()` returns the snapshot of the last
batch HANDED OUT (not the last one produced, which may be several batches ahead in the queue);
`load_state_dict()` re-reads (text: re-tokenizes) the buffered documents and continues the
stream, so a resumed loader yields exactly the batches an uninterrupted one would have. With
`source="auto"`, a state from text shards resumes on them even when binary shards were made since.

Validation. `split="val"` reads the last shard. With `repeat=True` (default) the stream cycles
forever, starting from the beginning for every new loader (deterministic: take a fixed number of
steps on every rank). With `repeat=False` it is one finite pass: the last batch is padded (targets
-1) and iteration then stops; ranks may get different batch counts, so a loop over it must keep
ranks in step (eval_bpb.evaluate_bpb agrees per batch whether any rank still has one).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat import dataset as ds
from nanochat.doc_sources import BinSource, TextSource, describe_shards
from nanochat.errors import MissingDataError, RequestError
from nanochat.packing import BestFitBuffer

STATE_VERSION = 1
IGNORE_INDEX = -1


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: got {value!r}; accepted: a positive integer")
    return value


# ---------------------------------------------------------------- the loader

class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class _Packer:
    """Best-fit packing over a document source; `batches(state)` is the generator the prefetch
    thread runs. Holds no reference to the DataLoader (see DataLoader._start)."""

    def __init__(self, source, *, batch_size: int, seq_len: int, buffer_size: int, bos: int,
                 repeat: bool, pin_memory: bool, config: dict, who: str):
        self.src, self.B, self.T, self.buffer_size = source, batch_size, seq_len, buffer_size
        self.bos, self.repeat, self.pin_memory, self.config, self.who = bos, repeat, pin_memory, config, who

    def stream(self, epoch: int, cursor: tuple):
        """(epoch, key, next_cursor, length, payload) from (epoch, cursor) on; cycles over passes
        when repeating; a full pass with no document longer than BOS is an error (nothing for this
        rank to learn from), and so is a first pass of the repeating train split with less than one
        batch (DataLoader._check_documents)."""
        while True:
            fresh, n, held = tuple(cursor) == self.src.start, 0, 0
            for key, nxt, length, payload in self.src.docs(tuple(cursor)):
                n, held = n + (length > 1), held + min(length, self.T + 1)
                yield epoch, key, nxt, length, payload
            if fresh and n == 0:
                raise MissingDataError(f"{self.who} has no non-empty documents (only BOS after encoding) "
                                       f"{describe_shards(self.src)}; re-create the data")
            if fresh and self.repeat and self.config["split"] == "train" and held < self.B * (self.T + 1):
                raise MissingDataError(_too_small(self.who, f"{held:,} tokens in one pass", self.src, self.B, self.T))
            if not self.repeat:
                return
            epoch, cursor = epoch + 1, self.src.start

    def batches(self, state: dict, stop: threading.Event | None = None):
        """Generator of (batch: (2, B, T) int64 tensor of inputs and targets, state after it);
        returns early once `stop` is set (the prefetch thread's close() signal)."""
        src, B, cap = self.src, self.B, self.T + 1
        epoch, cursor = state["epoch"], tuple(state["cursor"])
        read, dropped, batches = state["tokens_read"], state["tokens_dropped"], state["batches"]
        buf = BestFitBuffer()
        keys = [tuple(k) for k in state["buffer"]]
        for key, (length, payload) in zip(keys, src.fetch(keys)):
            buf.add(key, min(length, cap), payload, length)
        stream, exhausted = self.stream(epoch, cursor), False
        rows = np.empty((B, cap), dtype=np.int64)
        while True:
            valid = np.full(B, cap)
            for b in range(B):
                pos = 0
                while pos < cap:
                    while len(buf) < self.buffer_size and not exhausted:
                        if stop is not None and stop.is_set():  # close(): between documents, not
                            return                              # after a whole (slow) batch
                        try:
                            epoch, key, cursor, length, payload = next(stream)
                        except StopIteration:
                            exhausted = True
                            break
                        buf.add(key, min(length, cap), payload, length)  # longer than a row: cropped now
                        read += length
                        dropped += max(length - cap, 0)
                    if not buf:
                        break
                    key, length, payload = buf.take(cap - pos)
                    take = min(length, cap - pos)
                    rows[b, pos:pos + take] = src.tokens(key, payload, take)
                    dropped += length - take
                    pos += take
                rows[b, pos:] = self.bos  # only a finite pass's final batch gets here with pos < cap
                valid[b] = pos
            if valid[0] == 0:
                return
            out = torch.empty((2, B, self.T), dtype=torch.long, pin_memory=self.pin_memory)
            arr = out.numpy()
            arr[0] = rows[:, :-1]
            arr[1] = rows[:, 1:]
            for b in np.nonzero(valid < cap)[0]:
                arr[1, b, max(valid[b] - 1, 0):] = IGNORE_INDEX
            batches += 1
            yield out, {**self.config, "epoch": epoch, "cursor": list(cursor), "buffer": buf.keys(),
                        "tokens_read": read, "tokens_dropped": dropped, "batches": batches,
                        "tokens_buffered": [buf.held, buf.cropped]}


_RUNNING: set[tuple[threading.Event, threading.Thread]] = set()  # live prefetch threads
_EXIT_HOOK: list[bool] = []


def _stop_all_at_exit() -> None:
    """Stop prefetch threads before interpreter teardown: a daemon thread still inside pyarrow's
    C++ reader while the process exits makes the C++ runtime abort ("terminate called...")."""
    for stop, _ in list(_RUNNING):
        stop.set()
    for _, thread in list(_RUNNING):
        thread.join(timeout=60)


def _prefetch(gen, q: queue.Queue, stop: threading.Event) -> None:
    """Thread body: move batches from `gen` into the bounded queue until told to stop."""
    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    try:
        for item in gen:
            if not put(item):
                return
        put(_END)
    except BaseException as e:  # handed to the consumer, which re-raises it
        put(_Failure(e))


# loader state fields and what sets them (a resume with other values is refused naming these)
_STATE_FLAGS = {"batch_size": "--device-batch-size", "seq_len": "--max-seq-len", "world_size": "world size",
                "shards": "the shards of --data-dir", "shard_bytes": "the shard sizes of --data-dir",
                "source": "shards of kind (text / bin)", "fingerprint": "the tokenizer"}


def _too_small(who: str, held: str, source, B: int, T: int) -> str:
    """The repeating train split with less than one batch for this rank: every batch would repeat it."""
    ranks = ", or use fewer ranks" if source.world > 1 else ""
    return (f"{who} holds {held} {describe_shards(source)}, less than one batch of {B} rows of {T + 1} tokens "
            f"(the training scripts' --device-batch-size {B} and --max-seq-len {T}; each row starts a document, "
            "documents are cropped to a row): every batch would repeat the same documents; add documents, or "
            f"lower the batch size or the sequence length{ranks}")


def _brief(value) -> str:
    """A loader state value for a message: shard lists by count and ends, not in full."""
    if isinstance(value, list) and len(value) > 3:
        return f"[{value[0]!r}, ..., {value[-1]!r}] ({len(value)} shards)"
    return repr(value)


class DataLoader:
    """Iterator of (inputs, targets), LongTensor (B, T) on `device`. See the module docstring."""

    def __init__(self, tokenizer, batch_size: int, seq_len: int, split: str, *, device="cpu",
                 data_dir=None, bin_dir=None, rank: int = 0, world_size: int = 1,
                 source: str = "auto", buffer_size: int = 1000, prefetch: int = 4,
                 repeat: bool = True, tokenizer_threads: int | None = None,
                 encode_batch: int = 128, pin_memory: bool | None = None):
        self.B = _positive_int(batch_size, "batch_size")
        self.T = _positive_int(seq_len, "seq_len")
        if split not in ("train", "val"):
            raise ValueError(f"split: got {split!r}; accepted: train|val")
        if source not in ("auto", "text", "bin"):
            raise ValueError(f"source: got {source!r}; accepted: auto|text|bin")
        _positive_int(world_size, "world_size")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank: got {rank!r}; accepted: 0..{world_size - 1} (world_size {world_size})")
        self.buffer_size = _positive_int(buffer_size, "buffer_size")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch: got {prefetch!r}; accepted: 0 (synchronous) or more batches")
        threads = tokenizer_threads if tokenizer_threads is not None else min(4, os.cpu_count() or 1)
        _positive_int(threads, "tokenizer_threads")
        _positive_int(encode_batch, "encode_batch")
        self.tokenizer, self.split, self.rank, self.world_size = tokenizer, split, rank, world_size
        self.repeat, self.prefetch = bool(repeat), prefetch
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self.bos = int(tokenizer.bos_token_id)

        self._data_dir = Path(data_dir) if data_dir is not None else ds.default_data_dir()
        self._bin_dir = Path(bin_dir) if bin_dir is not None else bs.default_bin_dir(self._data_dir)
        self._threads, self._encode_batch = threads, encode_batch
        self._auto = source == "auto"  # then a resume may go back to the kind its checkpoint read
        if source == "auto":
            source = "bin" if bs.list_bin_shards(self._bin_dir) else "text"
            if source == "bin":
                self._check_fresh(self._bin_dir, self._data_dir)
        self._gen = self._thread = None
        self._use(self._make_source(source))

    def _make_source(self, kind: str):
        """A checked document source of `kind` for this loader's split and rank."""
        if kind == "bin":
            source = BinSource(runs.split_paths(self._bin_dir, self.split), self.tokenizer, self.rank,
                                self.world_size)
        else:
            shards = ds.split_shards(ds.list_shards(self._data_dir), self.split)
            source = TextSource(shards, self.tokenizer, self.rank, self.world_size, self._threads,
                                 self._encode_batch)
        self._check_documents(source)
        return source

    def _use(self, source) -> None:
        """Read from `source`, from the start (the loader must be closed)."""
        self._source = source
        self.source_dir = self._bin_dir if source.kind == "bin" else self._data_dir
        self._packer = _Packer(source, batch_size=self.B, seq_len=self.T, buffer_size=self.buffer_size,
                               bos=self.bos, repeat=self.repeat, pin_memory=self.pin_memory,
                               config=self._config(source), who=self._who())
        self._resume = self._state = self._initial_state()

    def _who(self) -> str:
        return f"split {self.split!r} (rank {self.rank} of {self.world_size})"

    def _check_documents(self, source) -> None:
        """Up front, from footers and headers: a split with nothing to read is an error now, not
        after a model was built (the stream repeats the check for what only reading shows)."""
        where, docs = describe_shards(source), source.rank_doc_count()
        if docs == 0:
            raise MissingDataError(f"{self._who()} has no documents {where}; re-create the data "
                                   "with more documents or use fewer ranks")
        if source.all_empty():
            raise MissingDataError(f"{self._who()} has no non-empty documents (every text is empty) {where}; "
                                   "re-create the data")
        # the repeating train split with less than a batch (cycled inside every batch): a binary one's
        # tokens are known now; a text one's once its first pass is read (_Packer.stream: after what
        # reading shows, a damaged or all-empty shard, which is the error to report then)
        cap = self.T + 1
        if self.repeat and self.split == "train" and source.kind == "bin" and source.rank_tokens(cap) < self.B * cap:
            held = f"{source.rank_tokens(cap):,} tokens in one pass"
            raise MissingDataError(_too_small(self._who(), held, source, self.B, self.T))

    @staticmethod
    def _check_fresh(bin_dir: Path, data_dir: Path) -> None:
        """Binary shards picked automatically must be a finished pretokenize run made from the text
        shards now in data_dir (binshards_runs.check_fresh)."""
        text = ds.list_shards(data_dir) if data_dir.is_dir() and any(data_dir.glob("*.parquet")) else []
        runs.check_fresh(bin_dir, text, data_dir)

    def describe_source(self) -> str:
        """What this loader reads, for start-up banners: `binary token shards DIR` or `text shards DIR`."""
        kind = "binary token shards" if self._source.kind == "bin" else "text shards"
        return f"{kind} {self.source_dir}"

    def pass_size(self):
        """One pass over this split on every rank of this loader's world, in training targets
        (nanochat/data_passes.py): exact for binary shards, estimated for text shards."""
        from nanochat.data_passes import pass_size
        return pass_size(self._source, self.T + 1, self.buffer_size)

    # ------------------------------------------------------------------ state

    def _config(self, source=None) -> dict:
        source = source or self._source
        return {"version": STATE_VERSION, "source": source.kind, "split": self.split,
                "batch_size": self.B, "seq_len": self.T, "rank": self.rank,
                "world_size": self.world_size, "buffer_size": self.buffer_size,
                "repeat": self.repeat, "shards": list(source.names),
                "shard_bytes": list(source.sizes), "fingerprint": self.tokenizer.fingerprint,
                "shard_digests": list(getattr(source, "digests", []))}

    def _initial_state(self) -> dict:
        return {**self._config(), "epoch": 0, "cursor": list(self._source.start), "buffer": [],
                "tokens_read": 0, "tokens_dropped": 0, "batches": 0}

    def rewind(self) -> None:
        """Back to the start of the same shards, for one more pass (base_train: each evaluation). The
        files were listed once: a pretokenize run adding or re-making shards meanwhile changes nothing."""
        self.close()
        self._use(self._source)

    @property
    def source_kind(self) -> str:
        """"text" or "bin": what this loader reads now (a resume may switch it back to its checkpoint's)."""
        return self._source.kind

    def state_dict(self) -> dict:
        """Plain-python state after the last batch handed out (prefetched batches excluded)."""
        s = self._state
        return {**s, "cursor": list(s["cursor"]), "buffer": [list(k) for k in s["buffer"]],
                "shards": list(s["shards"]), "shard_bytes": list(s["shard_bytes"])}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batch `state` was taken at. ValueError if it was made with
        a different configuration (ranks, shards, tokenizer, ...). The batch size may differ: rows
        are packed one after another whatever it is (a state falls between rows), so a resume at a
        lower --device-batch-size (what an out-of-memory stop advises) reads the very same rows."""
        if not isinstance(state, dict):
            raise ValueError(f"state: got {type(state).__name__}; accepted: a dict from state_dict()")
        source = self._source_for(state.get("source"))
        if source.kind == "bin":  # a shard truncated or rewritten since: DataError naming it
            bs.check_resume(source.paths, state, source.digests)
        for key, want in self._config(source).items():
            if key not in ("shard_digests", "batch_size") and state.get(key) != want:  # digests: checked above
                raise RequestError(f"--resume: the checkpoint's data loader had {_STATE_FLAGS.get(key, key)} "
                                   f"{_brief(state.get(key))}, this run's has {_brief(want)}; resume with the "
                                   "original run's data and flags (or start a new --model-tag)")
        self.close()
        if source is not self._source:
            self._use(source)
        self._resume = self._state = {**state, "batch_size": self.B, "buffer": [list(k) for k in state["buffer"]]}

    def _source_for(self, kind):
        """The source a checkpoint's state continues on. Picked automatically, it is the kind the
        checkpoint read: a run started on text shards and pretokenized since resumes on the text
        shards (its exact stream; there is no flag to pick the kind). Binary shards gone since
        cannot be replaced by the text shards: their stream differs across ranks."""
        if not self._auto or kind == self._source.kind or kind not in ("text", "bin"):
            return self._source
        if kind == "bin":
            raise RequestError(f"--resume: the checkpoint's data loader read binary token shards, and "
                               f"{self._bin_dir} holds none now; re-create them with `python -m "
                               f"scripts.pretokenize --data-dir {self._data_dir}` (same tokenizer and text "
                               "shards), or start a new --model-tag")
        try:
            return self._make_source(kind)
        except MissingDataError as e:  # text shards deleted after pretokenizing: say why they are needed
            # (its own advice, to download data, would make other shards: the resume refuses those too)
            raise MissingDataError(f"--resume: the checkpoint's data loader read the text shards of "
                                   f"{self._data_dir}, which are not there now ({str(e).split(';')[0]}); the "
                                   f"binary token shards in {self._bin_dir} cannot continue its stream: put "
                                   "the text shards it read back, or start a new --model-tag") from None

    @property
    def dropped_fraction(self) -> float:
        """Tokens cropped away by packing / tokens of the documents packed so far (into the batches
        handed out). Documents still in the packing buffer count in neither: they are read but not
        yet packed, and early on (a profile, a short run) they would dilute the figure severalfold."""
        held, cropped = self._state.get("tokens_buffered", (0, 0))  # absent: a state from before it
        read = self._state["tokens_read"] - held
        return (self._state["tokens_dropped"] - cropped) / read if read > 0 else 0.0

    @property
    def epoch(self) -> int:
        return self._state["epoch"]

    # ------------------------------------------------------------------ producing batches

    def _start(self) -> None:
        if not self.prefetch:
            self._gen = self._packer.batches(self._resume)
        else:
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._stop = threading.Event()
            self._gen = self._packer.batches(self._resume, self._stop)
            # The thread holds the packer, not the loader, so a loader that is dropped without
            # close() is still garbage-collected and its __del__ stops the thread.
            self._thread = threading.Thread(target=_prefetch, args=(self._gen, self._queue, self._stop),
                                            name="nanochat-dataloader", daemon=True)
            if not _EXIT_HOOK:
                atexit.register(_stop_all_at_exit)
                _EXIT_HOOK.append(True)
            _RUNNING.add((self._stop, self._thread))
            self._thread.start()

    def close(self) -> None:
        """Stop the prefetch thread (if any) and drop batches produced but not handed out."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()  # the producer checks the flag between documents and batches
            _RUNNING.discard((self._stop, self._thread))
        self._gen = self._thread = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to clean up
            pass

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gen is None:
            self._start()
        if self._thread is None:
            try:
                batch, state = next(self._gen)
            except BaseException:  # the generator is dead now: a next call would say "the end";
                self._gen = None   # it starts again after the last batch handed out instead
                raise
        else:
            item = self._queue.get()
            if item is _END:
                self._queue.put(_END)  # later calls keep raising StopIteration
                raise StopIteration
            if isinstance(item, _Failure):
                self._queue.put(item)
                raise item.exc
            batch, state = item
        self._state = self._resume = state
        if self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=self.pin_memory)
        return batch[0], batch[1]
