"""The server's model replicas: a `Worker` per generation slot, `replica_workers` (one Engine, or
`slots` rows of a BatchedEngine sharing it), the FIFO `WorkerPool` requests wait in, and the
per-client concurrency limit. nanochat/server.py serves HTTP over them (and re-exports them)."""
import asyncio
from collections import defaultdict, deque

from nanochat.chat_api import ApiError


class Worker:
    """One model replica (an Engine on one device) and its counters."""

    def __init__(self, engine, name: str):
        self.engine, self.tokenizer, self.name = engine, engine.tokenizer, name
        self.busy = False
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
    """FIFO hand-out of idle workers. Cancellation-safe: a waiter cancelled after being handed a
    worker passes it on, so no worker is ever lost."""

    def __init__(self, workers: list[Worker]):
        if not workers:
            raise ValueError("workers: need at least one model replica")
        self.workers = list(workers)
        self._idle = deque(self.workers)
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def available(self) -> int:
        return len(self._idle)

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def claim(self) -> asyncio.Future:
        """A place in line for the next free worker, taken now: a future of the worker (done at once
        when one is idle), counted by `waiting` from this call on, so an admission check just after
        sees it (a burst of requests cannot all pass a `waiting < max_queue` check before any of
        them queues). Its holder releases the worker or cancels the future (_release_unused)."""
        fut = asyncio.get_running_loop().create_future()
        if self._idle and not self.waiting:
            worker = self._idle.popleft()
            worker.busy = True
            fut.set_result(worker)
        else:
            while self._waiters and self._waiters[0].done():   # places given up (cancelled) at the front
                self._waiters.popleft()
            self._waiters.append(fut)
        return fut

    def release(self, worker: Worker) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                worker.busy = True   # handed on
                fut.set_result(worker)
                return
        worker.busy = False
        self._idle.append(worker)

    def fail_waiting(self, error) -> None:
        """Ends every place in line with the exception `error()` (shutting down): each holder answers
        its request with it; no worker is handed to them."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error())


class _ClientSlots:
    """Concurrent requests per client address; acquire() returns an idempotent release."""

    def __init__(self, limit: int):
        self.limit, self.active = limit, defaultdict(int)

    def acquire(self, key: str):
        if self.active.get(key, 0) >= self.limit:
            raise ApiError(429, f"too many concurrent requests from this client (limit {self.limit}); "
                                "wait for one to finish", code="too_many_concurrent_requests",
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
