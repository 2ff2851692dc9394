"""The packing buffer of the pretraining dataloader (nanochat/dataloader.py, whose docstring gives
the packing rules): buffered documents kept sorted by length for best-fit lookups, in an order a
loader state can record and restore exactly."""

from __future__ import annotations

import bisect


class BestFitBuffer:
    """Buffered documents: sorted (length, seq) for best-fit lookups plus insertion order (the
    order a snapshot records, so a restored buffer breaks ties identically)."""

    def __init__(self):
        self.order: list[tuple[int, int]] = []
        self.items: dict[int, tuple] = {}
        self.seq = 0
        self.held = 0     # tokens the buffered documents had when read (before any crop) ...
        self.cropped = 0  # ... and how many of those were cropped as they entered

    def __len__(self):
        return len(self.items)

    def add(self, key, length: int, payload, full: int | None = None) -> None:
        """`length` is cropped to a row: so are text tokens (copied: the buffer must not keep a
        long document's whole array alive; a binary source's payload is None, read when packed).
        `full`: the document's length before that crop (default `length`), for `held`/`cropped`."""
        if payload is not None and len(payload) > length:
            payload = payload[:length].copy()
        full = length if full is None else full
        bisect.insort(self.order, (length, self.seq))
        self.items[self.seq] = (key, length, payload, full)
        self.seq += 1
        self.held += full
        self.cropped += full - length

    def take(self, room: int) -> tuple:
        """The largest document of length <= room (the newest among equals), else the shortest."""
        i = bisect.bisect_right(self.order, (room, float("inf"))) - 1
        _, seq = self.order.pop(max(i, 0))
        key, length, payload, full = self.items.pop(seq)
        self.held -= full
        self.cropped -= full - length
        return key, length, payload

    def keys(self) -> list[list[int]]:
        return [list(item[0]) for item in self.items.values()]
