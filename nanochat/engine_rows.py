"""Per-row decode state and the argument checks of nanochat/engine.py (split out of it).

`_Row`: one sample's tool state machine and stop state; `ForcedTokens`: tool-forced tokens written
over a step's samples on the device before the lookahead step that feeds them is queued;
`validate_sampling` / `_check_int` / `_stop_ids`: the Engine's (and the batcher's) input checks,
each naming the argument and what it accepts."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch


@dataclass
class _Row:
    """Per-sample state of the tool state machine and the stop condition."""

    forced: deque = field(default_factory=deque)   # tokens the tool will force next
    in_python: bool = False
    expr: list = field(default_factory=list)        # tokens between python_start and python_end
    stop_token: int | None = None                  # set once the row has finished


class ForcedTokens:
    """Tool-forced tokens written over a step's samples on the device (through a pinned buffer)
    before the lookahead step that feeds them is queued: a row's next forced token is known a step
    ahead, and re-running the step cost the whole batch one more step per forced token."""

    def __init__(self, device, rows: int):
        self.device, self.rows, self._host = torch.device(device), rows, None

    def apply(self, sampled: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
        """`sampled` (R,) for `rows`, with every live row's next forced token in its place."""
        forced = [(i, r.forced[0]) for i, r in enumerate(rows) if r.stop_token is None and r.forced]
        if not forced:
            return sampled
        if self._host is None:
            cuda = self.device.type == "cuda"
            self._host = torch.zeros(self.rows, 2, dtype=torch.long, pin_memory=cuda)
            self._dev = torch.zeros(self.rows, 2, dtype=torch.long, device=self.device)
            self._copied = torch.cuda.Event() if cuda else None
        elif self._copied is not None:
            self._copied.synchronize()   # the previous copy has read the buffer
        n = len(forced)
        self._host[:n] = torch.tensor(forced)
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return sampled.index_put((self._dev[:n, 0],), self._dev[:n, 1])


def _check_int(value, name: str, low: int, accepted: str) -> int:
    # any Integral (numpy's int64 from a sweep, as token ids already are): int only refused
    # np.int64(2) with "accepted: an integer >= 1"; returned as a plain int
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise ValueError(f"{name}: got {value!r}; accepted: {accepted}")
    return int(value)


def validate_sampling(temperature, top_k, top_p) -> tuple[float, int | None, float | None]:
    """Checked sampling parameters; top_k 0 and top_p 1.0 mean 'off'."""
    # an int past float's range (10**400) compares as finite but float() raised OverflowError
    # Real, not (int, float): np.float32(0.7) was refused as "not a finite number >= 0"
    if isinstance(temperature, bool) or not isinstance(temperature, Real) \
            or not 0.0 <= temperature < float("inf") or not _fits_float(temperature):
        raise ValueError(f"temperature: got {temperature!r}; accepted: a finite number >= 0 (0 = greedy)")
    if top_k is not None:
        top_k = _check_int(top_k, "top_k", 0, "None or an integer >= 0 (0 = off)") or None
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, Real) or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: got {top_p!r}; accepted: None or a number in (0, 1]")
        top_p = None if float(top_p) >= 1.0 else float(top_p)
    return float(temperature), top_k, top_p


def _fits_float(value) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _stop_ids(stop_tokens) -> list[int]:
    """stop_tokens as ints; ValueError naming the argument for anything else (a token's text, None)."""
    try:
        if isinstance(stop_tokens, (str, bytes)):
            raise TypeError("text")
        return [operator.index(t) for t in stop_tokens]
    except (TypeError, ValueError):
        raise ValueError(f"stop_tokens: got {stop_tokens!r}; accepted: None or an iterable of token ids (ints)") \
            from None
