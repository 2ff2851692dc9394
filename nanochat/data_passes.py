"""How many passes over its training data a planned run makes (base_train's start-up banner and
warning). One pass is counted as the loader counts training tokens: the targets of the rows a
finite pass (`repeat=False`) of each rank's documents packs, T per full row (a row holds T + 1
tokens), after best-fit packing crops (nanochat/dataloader.py). Every rank trains the same number
of rows a step, so the rank with the smallest pass is the one that repeats its documents most.

Binary token shards: the lengths of every document are in the shard headers, so the packing is
replayed on the lengths alone (no token is read): exact, for every rank. Past `REPLAY_DOCS`
documents (a corpus so large that the replay would take seconds) it replays each rank's first
documents and scales their packed share to the rest: marked "~".

Text shards: token counts are only known by tokenizing, so the pass is estimated ("~") from the
parquet footers (the text column's size) and a small sample of documents tokenized: their tokens
per byte, and the packing replayed on lengths drawn from the sample. On the tiny and docs corpora
it lands within `TEXT_TOLERANCE` of the real pass (tests/test_data_passes74.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

REPLAY_DOCS = 400_000     # documents replayed in all (~1 s); beyond it, a per-rank prefix scaled
TEXT_SAMPLE_DOCS = 256    # documents tokenized for a text split's estimate
TEXT_TOLERANCE = 0.10     # what a text estimate's "~" stands for (measured: within 4% on both corpora)
MANY_PASSES = 10          # past this, the warning adds what repeating the data does to val bpb


def replay_packing(lengths: Iterable[int], cap: int, buffer_size: int, limit: int | None = None) -> tuple[int, int]:
    """(training targets, tokens read) of the rows that the loader's best-fit packing makes of
    documents of these lengths in one finite pass, the first `limit` documents only if given.
    Mirrors _Packer.batches: a document enters the buffer cropped to a row, the buffer is topped up
    to `buffer_size` before each pick, a row takes the longest document that fits, else the
    shortest cropped to fill it; a row filled to `pos` tokens holds pos - 1 targets. Which of
    several equal lengths is taken changes no count, so only lengths are kept."""
    buf: list[int] = []     # sorted lengths of the buffered documents
    docs, targets, read = iter(lengths.tolist() if isinstance(lengths, np.ndarray) else lengths), 0, 0
    left = limit if limit is not None else -1
    exhausted = False
    while True:
        pos = 0
        while pos < cap:
            while len(buf) < buffer_size and not exhausted:
                n = next(docs, None) if left != 0 else None
                if n is None:
                    exhausted = True
                    break
                left -= 1
                read += int(n)
                bisect.insort(buf, min(int(n), cap))
            if not buf:
                break
            i = bisect.bisect_right(buf, cap - pos) - 1
            pos += min(buf.pop(max(i, 0)), cap - pos)
        if pos == 0:
            return targets, read
        targets += pos - 1


@dataclass(frozen=True)
class PassSize:
    """One pass over a split: training targets per rank, whether exact, and how it was found."""

    rank_tokens: tuple[int, ...]
    exact: bool
    basis: str

    @property
    def tokens(self) -> int:
        return sum(self.rank_tokens)

    def passes(self, planned_tokens: int) -> float:
        """Passes over its documents that the rank repeating most makes in `planned_tokens` (all ranks)."""
        return planned_tokens / len(self.rank_tokens) / max(min(self.rank_tokens), 1)

    def describe(self, planned_tokens: int) -> str:
        """The banner's line: one pass's tokens, how they were found, and the passes the plan makes."""
        p, approx = self.passes(planned_tokens), "" if self.exact else "~"
        ranks = f" on {len(self.rank_tokens)} ranks" if len(self.rank_tokens) > 1 else ""
        return (f"one pass = {self._tokens()} training tokens{ranks} ({self.basis}); the planned "
                f"{planned_tokens:,} tokens are {approx}{_count(p)} pass{'es' * (p != 1)}")

    def _tokens(self) -> str:
        """The pass's tokens: exact, or an estimate to 3 significant digits (it is good to ~10%)."""
        return f"{self.tokens:,}" if self.exact else f"~{round(self.tokens, 3 - len(str(self.tokens))):,}"

    def warnings(self, planned_tokens: int) -> list[str]:
        """A warning when the plan reads its training documents more than once (none otherwise)."""
        if planned_tokens <= len(self.rank_tokens) * min(self.rank_tokens):   # passes <= 1, in integers
            return []
        p, approx = self.passes(planned_tokens), "" if self.exact else "~"
        lo, hi = math.floor(p), math.ceil(p)
        line = (f"the plan repeats the training data: {planned_tokens:,} tokens are {approx}{_count(p)} passes "
                f"over its {self._tokens()} training tokens, so each document is trained on "
                f"{approx}{lo if lo == hi else f'{lo} to {hi}'} times; for fewer passes add shards or shorten the "
                "run (base_train --num-iterations, --target-param-data-ratio)")
        if p > MANY_PASSES:
            line += (f". Over {MANY_PASSES} passes the training loss reflects repeated documents rather than new "
                     "text, and val bpb overstates quality if the val shard's documents also occur in the "
                     "training shards")
        return [line]


def _count(p: float) -> str:
    return f"{p:.2f}" if p < 10 else f"{p:,.0f}"


def pass_size(source, cap: int, buffer_size: int) -> PassSize:
    """One pass over `source`'s split (nanochat/doc_sources.py) on each rank of its world."""
    if source.kind == "bin":
        return _bin_pass(source, cap, buffer_size)
    return _text_pass(source, cap, buffer_size)


def _bin_pass(source, cap: int, buffer_size: int) -> PassSize:
    world = source.world
    if sum(len(n) for n in source.lengths) <= REPLAY_DOCS:
        return PassSize(tuple(replay_packing(source.rank_lengths(r), cap, buffer_size)[0] for r in range(world)),
                        True, "exact: the packing replayed on the binary shards' document lengths")
    limit, est = max(REPLAY_DOCS // world, buffer_size), []
    for r in range(world):   # the prefix's packed share of its (row-cropped) tokens, applied to the rest
        prefix = source.rank_lengths(r, limit)
        targets, _ = replay_packing(prefix, cap, buffer_size)
        est.append(round(source.rank_tokens(cap, r) * targets / max(int(np.minimum(prefix, cap).sum()), 1)))
    return PassSize(tuple(est), False, f"the packing replayed on each rank's first {limit:,} documents, "
                                       "scaled to the binary shards' document lengths")


def _text_pass(source, cap: int, buffer_size: int) -> PassSize:
    world, n_docs = source.world, source.doc_count()
    text_bytes, sample_bytes, sample_tokens = source.sample_docs(TEXT_SAMPLE_DOCS)
    assert sample_tokens, "a split without documents is refused when its loader is built"
    # tokens per byte without the BOS each document starts with (many short documents: BOS matters)
    per_byte = (sum(sample_tokens) - len(sample_tokens)) / max(sum(sample_bytes), 1)
    raw = text_bytes * per_byte + n_docs
    # the packing's share of those tokens, replayed on a rank's worth of lengths drawn from the
    # sample (fixed seed: the same banner for the same data)
    draw = np.random.default_rng(0).choice(np.asarray(sample_tokens), size=max(min(n_docs // world, 20_000), 1))
    targets, read = replay_packing(draw, cap, buffer_size)
    per_rank = round(raw / world * targets / max(read, 1))
    return PassSize((per_rank,) * world, False, f"estimated from the text shards' sizes and {len(sample_tokens)} "
                                                f"documents tokenized, +-{TEXT_TOLERANCE:.0%}")
