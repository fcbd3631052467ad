"""Admission control: who may generate now, who waits, who is refused.

The serialized route of vllm-mlx's `SimpleEngine` contract: one generation at a time
(`slots=1`). A request that finds every slot taken is either refused at once with `EngineBusy`
(`mode="fail-fast"`, the default) or waits in a bounded FIFO queue (`mode="wait"`, at most
`max_waiting` waiters, each for at most `max_wait` seconds) and is refused when the queue is
full or its wait runs out.

`AdmissionBook` is the state and its rules, plain and synchronous (testable without Trio);
`AdmissionController` adds the waiting. A `Lease` frees its slot with a synchronous, idempotent
`release()`, so it can be released in a `finally` even inside a cancelled scope. A released slot
is handed straight to the first waiter, so no newcomer can overtake the queue.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import trio

from trio_mlx.errors import EngineBusy, EngineClosed

AdmissionMode = Literal["fail-fast", "wait"]


@dataclass(frozen=True)
class AdmissionStats:
    """A snapshot of the admission state."""

    mode: AdmissionMode
    slots: int
    running: int
    waiting: int
    max_waiting: int
    admitted: int
    busy_rejections: int
    wait_timeouts: int
    #: request id -> seconds it has held its slot
    holders: dict[int, float]


class _Waiter:
    __slots__ = ("closed", "event", "granted")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.granted = False
        self.closed = False


class AdmissionBook:
    """The slots, the queue and the counters. Every method is synchronous and atomic under Trio."""

    def __init__(
        self, *, slots: int = 1, mode: AdmissionMode = "fail-fast", max_waiting: int = 0
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if mode not in ("fail-fast", "wait"):
            raise ValueError(f"unknown admission mode {mode!r}")
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.mode: AdmissionMode = mode
        self.slots = slots
        self.max_waiting = max_waiting if mode == "wait" else 0
        self._running: dict[int, float] = {}
        self._waiting: OrderedDict[int, _Waiter] = OrderedDict()
        self._closed = False
        self.admitted = 0
        self.busy_rejections = 0
        self.wait_timeouts = 0
        self._mean_hold = 1.0

    def try_admit(self, request_id: int) -> bool:
        """Take a free slot for `request_id` if there is one and nobody is queued before it."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if len(self._running) < self.slots and not self._waiting:
            self._grant(request_id)
            return True
        return False

    def enqueue(self, request_id: int) -> _Waiter:
        """Join the queue, or raise `EngineBusy` when this mode or the queue's size forbids it."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if len(self._waiting) >= self.max_waiting:
            self.busy_rejections += 1
            what = "the engine is busy" if self.mode == "fail-fast" else "the queue is full"
            raise EngineBusy(
                f"{what}: {len(self._running)} running, {len(self._waiting)} waiting",
                retry_after=self.retry_after(),
            )
        waiter = _Waiter()
        self._waiting[request_id] = waiter
        return waiter

    def leave_queue(self, request_id: int) -> None:
        """A waiter gave up (cancelled or timed out) before it was granted a slot."""
        self._waiting.pop(request_id, None)

    def release(self, request_id: int) -> None:
        """Free `request_id`'s slot (idempotent) and hand it to the first waiter."""
        started = self._running.pop(request_id, None)
        if started is None:
            return
        held = time.monotonic() - started
        self._mean_hold = 0.8 * self._mean_hold + 0.2 * held
        while self._waiting and len(self._running) < self.slots:
            next_id, waiter = self._waiting.popitem(last=False)
            self._grant(next_id)
            waiter.granted = True
            waiter.event.set()

    def close(self) -> None:
        """Refuse everything from now on and wake every waiter (they raise `EngineClosed`)."""
        self._closed = True
        for waiter in self._waiting.values():
            waiter.closed = True
            waiter.event.set()
        self._waiting.clear()

    def retry_after(self) -> float:
        """Seconds until a retry will likely find a slot: the queue ahead times the mean hold."""
        ahead = len(self._waiting) + 1
        return float(min(60, max(1, math.ceil(self._mean_hold * ahead / self.slots))))

    def statistics(self) -> AdmissionStats:
        now = time.monotonic()
        return AdmissionStats(
            mode=self.mode,
            slots=self.slots,
            running=len(self._running),
            waiting=len(self._waiting),
            max_waiting=self.max_waiting,
            admitted=self.admitted,
            busy_rejections=self.busy_rejections,
            wait_timeouts=self.wait_timeouts,
            holders={rid: now - t for rid, t in self._running.items()},
        )

    def _grant(self, request_id: int) -> None:
        self._running[request_id] = time.monotonic()
        self.admitted += 1


class Lease:
    """The right to generate. `release()` is synchronous and idempotent."""

    __slots__ = ("_book", "_released", "request_id")

    def __init__(self, book: AdmissionBook, request_id: int) -> None:
        self._book = book
        self.request_id = request_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._book.release(self.request_id)


class AdmissionController:
    """Grants leases according to an `AdmissionBook`; waiting is the only thing it awaits."""

    def __init__(self, book: AdmissionBook, *, max_wait: float = 30.0) -> None:
        self.book = book
        self.max_wait = max_wait

    async def acquire(self, request_id: int) -> Lease:
        """A lease for `request_id`, or `EngineBusy` / `EngineClosed`. Always a checkpoint."""
        await trio.lowlevel.checkpoint()
        if self.book.try_admit(request_id):
            return Lease(self.book, request_id)
        waiter = self.book.enqueue(request_id)
        try:
            with trio.move_on_after(self.max_wait):
                await waiter.event.wait()
        except BaseException:
            # Cancelled while queued: leave the queue, or give back a slot granted meanwhile.
            if waiter.granted:
                self.book.release(request_id)
            else:
                self.book.leave_queue(request_id)
            raise
        if not waiter.event.is_set():
            self.book.leave_queue(request_id)
        if waiter.closed:
            raise EngineClosed("the engine is shutting down")
        if not waiter.granted:
            self.book.wait_timeouts += 1
            self.book.busy_rejections += 1
            raise EngineBusy(
                f"no slot became free within {self.max_wait:g} s",
                retry_after=self.book.retry_after(),
                reason="timeout",
            )
        return Lease(self.book, request_id)
