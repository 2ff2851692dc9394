"""The server's model replicas: a `Worker` per generation slot, `replica_workers` (one Engine, or
`slots` rows of a BatchedEngine sharing it), the FIFO `WorkerPool` requests wait in (it also counts
the free generation rows /health reports), and the per-client concurrency limit.
nanochat/server.py serves HTTP over them (and re-exports them)."""
import asyncio
from collections import defaultdict, deque

from nanochat.chat_api import ApiError


class Worker:
    """One model replica (an Engine on one device) and its counters."""

    def __init__(self, engine, name: str):
        self.engine, self.tokenizer, self.name = engine, engine.tokenizer, name
        self.busy = False
        self.rows = 0   # generation rows its request holds (the request's n); 0 while idle
        self.requests = self.tokens = 0
        self.busy_seconds = 0.0


def replica_workers(engine, name: str, slots: int = 1) -> list[Worker]:
    """The workers of one model replica: `slots` > 1 -> that many sharing a BatchedEngine over
    `engine` (continuous batching; call `.engine.warmup()` on one of them before serving), 1 ->
    one worker on the plain Engine."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"batch slots: got {slots!r}; accepted: an integer >= 1 (1 = no batching)")
    if slots == 1:
        return [Worker(engine, name)]
    from nanochat.batching import BatchedEngine

    batched = BatchedEngine(engine, slots)
    return [Worker(batched, f"{name}/{i}") for i in range(slots)]


class WorkerPool:
    """Hands idle workers to requests in the order they came (FIFO). Cancellation-safe: a waiter
    cancelled after being handed a worker passes it on, so no worker is ever lost.

    Rows: a batched replica's workers share its BatchedEngine's `slots` rows, and a request of n
    samples holds n of them (a request on a full replica holds a worker but waits inside the
    BatchedEngine for rows), so idle workers overstate what is free. `available` counts free rows,
    and `claim` hands out the idle worker whose replica has the most free rows: on one replica
    with all its rows taken by an n = 4 request, a request sent to another idle replica starts at
    once; handed the first idle worker (chat_web lists replica 0's slots first) it waited."""

    def __init__(self, workers: list[Worker]):
        if not workers:
            raise ValueError("workers: need at least one model replica")
        self.workers = list(workers)
        self._idle = deque(self.workers)
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()   # (place in line, rows it asks for)
        # the workers that share rows: a batched replica's (its engine has `slots`), else each alone
        self._replica: dict[int, list[Worker]] = {}   # key -> its workers
        self._replica_of: dict[int, int] = {}          # id(worker) -> its replica's key
        for w in self.workers:   # (getattr: the pool needs only `busy` of a worker without batching)
            engine = getattr(w, "engine", None)
            key = id(engine) if hasattr(engine, "slots") else id(w)
            self._replica.setdefault(key, []).append(w)
            self._replica_of[id(w)] = key

    @staticmethod
    def _rows_of(group: list[Worker]) -> int:
        """A replica's generation rows: its BatchedEngine's slots, else 1 (one request at a time)."""
        return getattr(getattr(group[0], "engine", None), "slots", 1)

    def _unheld_rows(self, group: list[Worker]) -> int:
        """A replica's rows less those its requests hold: negative when requests wait inside it."""
        return self._rows_of(group) - sum(getattr(w, "rows", 0) for w in group)

    def _free_rows(self, group: list[Worker]) -> int:
        """Rows of one replica a new request could start on now: its unheld rows, and no more than
        its idle workers (each request needs one)."""
        idle = sum(1 for w in group if not w.busy)
        return max(0, min(self._unheld_rows(group), idle))

    @property
    def available(self) -> int:
        """Free generation rows over all replicas (server.py's module docstring says what /health
        reports): 0 -> a new request waits, for a worker or for rows."""
        return sum(self._free_rows(group) for group in self._replica.values())

    @property
    def slots(self) -> int:
        """Generation rows in all: every batched replica's slots, plus 1 per unbatched worker."""
        return sum(self._rows_of(group) for group in self._replica.values())

    @property
    def waiting(self) -> int:
        return sum(1 for f, _ in self._waiters if not f.done())

    def _take_idle(self, rows: int) -> Worker:
        """The idle worker whose replica has the most unheld rows; ties: the one idle longest (FIFO).
        Unheld, not free (floored at 0): when every replica is full, the one with the fewest requests
        already waiting inside it gets the next (a request never moves to another replica)."""
        free = {key: self._unheld_rows(group) for key, group in self._replica.items()}
        best = max(range(len(self._idle)), key=lambda i: (free[self._replica_of[id(self._idle[i])]], -i))
        worker = self._idle[best]
        del self._idle[best]
        self._hand(worker, rows)
        return worker

    @staticmethod
    def _hand(worker: Worker, rows: int) -> None:
        worker.busy, worker.rows = True, rows

    def claim(self, rows: int = 1) -> asyncio.Future:
        """A place in line for the next free worker, taken now: a future of the worker (done at once
        when one is idle), counted by `waiting` from this call on, so an admission check just after
        sees it (a burst of requests cannot all pass a `waiting < max_queue` check before any of
        them queues). `rows`: the generation rows the request will hold (its n), counted against
        its worker's replica until the worker is released. Its holder releases the worker or
        cancels the future (_release_unused)."""
        fut = asyncio.get_running_loop().create_future()
        if self._idle and not self.waiting:
            fut.set_result(self._take_idle(rows))
        else:
            while self._waiters and self._waiters[0][0].done():   # places given up (cancelled) at the front
                self._waiters.popleft()
            self._waiters.append((fut, rows))
        return fut

    def release(self, worker: Worker) -> None:
        while self._waiters:
            fut, rows = self._waiters.popleft()
            if not fut.done():
                self._hand(worker, rows)   # handed on
                fut.set_result(worker)
                return
        worker.busy, worker.rows = False, 0
        self._idle.append(worker)

    def fail_waiting(self, error) -> None:
        """Ends every place in line with the exception `error()` (shutting down): each holder answers
        its request with it; no worker is handed to them."""
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error())


class _ClientSlots:
    """Concurrent requests per client address; acquire() returns an idempotent release."""

    def __init__(self, limit: int):
        self.limit, self.active = limit, defaultdict(int)

    def acquire(self, key: str):
        if self.active.get(key, 0) >= self.limit:
            # named in full: a batch job (asyncio.gather, LangChain .batch()) past the limit fails
            # after its client's retries; its owner needs the concurrency to send or the flag to raise
            raise ApiError(429, f"too many concurrent requests from this client (limit {self.limit}, the "
                                "server's --max-concurrent-per-client): wait for one to finish, or send at "
                                f"most {self.limit} at a time", code="too_many_concurrent_requests",
                           headers={"Retry-After": "1"})
        self.active[key] += 1
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                self.active[key] -= 1
                if not self.active[key]:
                    del self.active[key]
        return release
