"""The preparation worker: chat templates and tokenization off the event loop, in arrival order.

Requests are prepared one at a time (the `RequestPreparer` and the tokenizer are not shared between
threads), on a worker thread, so that the event loop (every other stream, `/health`) never waits
for a tokenization. What a burst needs besides is that the worker never waits for the event loop:
a job per `trio.to_thread.run_sync` behind a `CapacityLimiter(1)` cost each request a round trip
through the event loop before the next one could start (the worker's result handed back, the
limiter released, the next task scheduled, its thread started), and under a burst of HTTP requests
that loop is busy: on a 2-core CPU the 16th of 16 chat requests of ~130 tokens waited ~60 ms for
15 preparations of 0.5 ms each. Here a job is queued (FIFO, arrival order) and one drain on a
worker thread runs every queued job back to back, handing each result to the event loop with
`TrioToken.run_sync_soon` without waiting for it; a drain ends when the queue is empty (its thread
goes back to Trio's thread cache) and the next job starts another.

`run(work, then=...)`: `then` runs on the Trio thread as soon as `work` is done, synchronously and
in the jobs' order: what it does (the engine's admission and submission) happens in arrival
order, whatever order the Trio scheduler then wakes the callers in.

Cancelling a caller abandons its job: one still queued is dropped unstarted; one the worker is
running is finished and its result dropped, without `then` (the next job starts meanwhile); a
result `then` has already made is handed to `discard` (the engine closes the admitted request).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

T = TypeVar("T")
U = TypeVar("U")

THREAD_NAME = "trio-mlx-prepare"


class _Job(Generic[T, U]):
    __slots__ = ("abandoned", "discard", "done", "result", "then", "token", "work")

    def __init__(
        self,
        work: Callable[[], T],
        then: Callable[[T], U] | None,
        discard: Callable[[U], None] | None,
        token: trio.lowlevel.TrioToken,
    ) -> None:
        self.work = work
        self.then = then
        self.discard = discard
        self.token = token
        self.done = trio.Event()
        self.result: outcome.Outcome[U] | None = None
        self.abandoned = False


class PreparationQueue:
    """One job at a time on a worker thread, in the order they were queued (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[_Job[Any, Any]] = deque()
        self._draining = False
        #: jobs run (for tests and statistics)
        self.completed = 0

    def __len__(self) -> int:
        """Jobs queued, not yet started."""
        return len(self._jobs)

    async def run(
        self,
        work: Callable[[], T],
        then: Callable[[T], U] | None = None,
        discard: Callable[[U], None] | None = None,
    ) -> U:
        """`work()` on the worker thread, then `then(result)` on the Trio thread (see the module
        docstring); their result, or the exception either raised."""
        job: _Job[T, U] = _Job(work, then, discard, trio.lowlevel.current_trio_token())
        with self._lock:
            self._jobs.append(job)
            start = not self._draining
            self._draining = True
        if start:
            try:
                trio.lowlevel.start_thread_soon(self._drain, _ignore, name=THREAD_NAME)
            except BaseException:
                with self._lock:
                    self._draining = False
                    self._jobs.remove(job)
                raise
        try:
            await job.done.wait()
        except BaseException:
            job.abandoned = True
            with self._lock:
                if job in self._jobs:
                    self._jobs.remove(job)
            if job.result is not None and job.discard is not None:
                # `then` ran before the cancellation could be delivered: undo what it made.
                made = job.result
                job.result = None
                if isinstance(made, outcome.Value):
                    job.discard(made.value)
            raise
        assert job.result is not None
        return job.result.unwrap()

    def _drain(self) -> None:
        """On a worker thread: run the queued jobs until there are none."""
        while True:
            with self._lock:
                if not self._jobs:
                    self._draining = False
                    return
                job = self._jobs.popleft()
            if job.abandoned:
                continue
            result = outcome.capture(job.work)
            self.completed += 1
            with contextlib.suppress(trio.RunFinishedError):  # that run is over: nobody waits
                job.token.run_sync_soon(_finish, job, result)


def _finish(job: _Job[T, U], result: outcome.Outcome[T]) -> None:
    """On the Trio thread, in the jobs' order: `then`, and wake the caller."""
    if job.abandoned:
        return
    if job.then is not None and isinstance(result, outcome.Value):
        then = job.then
        value = result.value
        job.result = outcome.capture(lambda: then(value))
    else:
        job.result = result  # type: ignore[assignment]  # without `then`, U is T
    job.done.set()


def _ignore(_result: outcome.Outcome[None]) -> None:
    pass
