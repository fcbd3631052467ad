"""Admission control: who may generate now, who waits, who is refused.

`slots` is the runner's `max_num_seqs` (1: the serialized route, one generation at a time). With
KV accounting (`account_kv`), a request is admitted only while the running requests' KV caches,
each at its token limit, fit in the budget with its own. A request that finds every slot taken (or
the budget spent) is either refused at once with `EngineBusy` (`mode="fail-fast"`, the engine
API's default) or waits in a bounded FIFO queue (`mode="wait"`, at most `max_waiting` waiters,
each for at most `max_wait` seconds) and is refused when the queue is full or its wait runs out.

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
    #: KV memory reserved by the running requests at their token limits, every row at the widest
    #: one's (`AdmissionBook.kv_footprint`), and the budget (0: none)
    kv_reserved_bytes: int = 0
    kv_budget_bytes: int = 0
    #: requests refused or queued because the KV budget was spent (not the slots)
    memory_waits: int = 0


class Waiter:
    """A request's place in the admission queue: `event` is set when it is granted a slot
    (`granted`) or the engine closes (`closed`)."""

    __slots__ = ("closed", "event", "granted", "kv_bytes")

    def __init__(self, kv_bytes: int = 0) -> None:
        self.event = trio.Event()
        self.granted = False
        self.closed = False
        self.kv_bytes = kv_bytes


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
        self._reserved: dict[int, int] = {}
        self._waiting: OrderedDict[int, Waiter] = OrderedDict()
        self._closed = False
        self.admitted = 0
        self.busy_rejections = 0
        self.wait_timeouts = 0
        self.memory_waits = 0
        self.kv_budget = 0
        self.kv_bytes_per_token = 0
        self._mean_hold = 1.0

    def account_kv(self, budget_bytes: int, bytes_per_token: int) -> None:
        """Admit requests only while the running ones' KV caches, each at the token limit of the
        widest of them, fit in `budget_bytes` (a request alone is always admitted;
        `kv_footprint` says why the widest)."""
        self.kv_budget = max(0, budget_bytes)
        self.kv_bytes_per_token = max(0, bytes_per_token)

    def kv_footprint(self, kv_bytes: int | None = None) -> int:
        """The running requests' KV memory at their limits, with one more of `kv_bytes` if
        given: every row at the widest one's. The decode batch keeps its rows in one buffer a
        layer, left-padded to its longest row (mlx-lm's `BatchKVCache`, `batch_layout`), so a
        row costs what the widest does: on an 8B model an 8,000-token request joining 16 short
        ones holds 17 rows of 8,000 positions, 18 GB, where their own caches hold 1.1 GB. A
        sum of each request's own limit would let one long request among many short ones past
        the budget, and the join would run the device out of memory. (A long prompt joining
        short rows gets a buffer of its own, `batch_segments`, but a short prompt with a large
        `max_tokens` grows its group's buffer to its width as it decodes: the bound stays.)"""
        limits = list(self._reserved.values())
        if kv_bytes is not None:
            limits.append(kv_bytes)
        return len(limits) * max(limits, default=0)

    def _fits(self, kv_bytes: int) -> bool:
        if len(self._running) >= self.slots:
            return False
        if not self.kv_budget or not self._running:
            return True
        return self.kv_footprint(kv_bytes) <= self.kv_budget

    def try_admit(self, request_id: int, kv_bytes: int = 0) -> bool:
        """Take a free slot for `request_id` if there is one, its KV memory fits and nobody is
        queued before it."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if not self._waiting and self._fits(kv_bytes):
            self._grant(request_id, kv_bytes)
            return True
        return False

    def enqueue(self, request_id: int, kv_bytes: int = 0) -> Waiter:
        """Join the queue, or raise `EngineBusy` when this mode or the queue's size forbids it."""
        if self._closed:
            raise EngineClosed("the engine is shutting down")
        if len(self._running) < self.slots and not self._waiting:
            self.memory_waits += 1  # a slot is free: the KV budget is what is missing
        if len(self._waiting) >= self.max_waiting:
            self.busy_rejections += 1
            what = "the engine is busy" if self.mode == "fail-fast" else "the queue is full"
            raise EngineBusy(
                f"{what}: {len(self._running)} running, {len(self._waiting)} waiting",
                retry_after=self.retry_after(),
            )
        waiter = Waiter(kv_bytes)
        self._waiting[request_id] = waiter
        return waiter

    def leave_queue(self, request_id: int) -> None:
        """A waiter gave up (cancelled or timed out) before it was granted a slot."""
        if self._waiting.pop(request_id, None) is not None:
            self._grant_waiters()  # it may have been the one that did not fit

    def release(self, request_id: int) -> None:
        """Free `request_id`'s slot (idempotent) and hand it to the first waiter."""
        started = self._running.pop(request_id, None)
        self._reserved.pop(request_id, None)
        if started is None:
            return
        held = time.monotonic() - started
        self._mean_hold = 0.8 * self._mean_hold + 0.2 * held
        self._grant_waiters()

    def _grant_waiters(self) -> None:
        """Hand free slots to the waiters in order while the first one fits."""
        while self._waiting:
            next_id, waiter = next(iter(self._waiting.items()))
            if not self._fits(waiter.kv_bytes):
                return
            del self._waiting[next_id]
            self._grant(next_id, waiter.kv_bytes)
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
        """Seconds until a retry will likely find a slot, from the measured mean time a request
        holds its slot: the queue ahead times that, shared by the slots (1 to 60)."""
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
            kv_reserved_bytes=self.kv_footprint(),
            kv_budget_bytes=self.kv_budget,
            memory_waits=self.memory_waits,
        )

    def _grant(self, request_id: int, kv_bytes: int = 0) -> None:
        self._running[request_id] = time.monotonic()
        self._reserved[request_id] = kv_bytes
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

    async def acquire(self, request_id: int, kv_bytes: int = 0) -> Lease:
        """A lease for `request_id` whose KV cache takes `kv_bytes` at its token limit, or
        `EngineBusy` / `EngineClosed`. Always a checkpoint."""
        await trio.lowlevel.checkpoint()
        entry = self.enter(request_id, kv_bytes)
        if isinstance(entry, Lease):
            return entry
        return await self.wait(request_id, entry)

    def enter(self, request_id: int, kv_bytes: int = 0) -> Lease | Waiter:
        """Synchronously: a lease if a slot is free (and nobody waits), else a place in the
        queue to `wait` on; `EngineBusy` / `EngineClosed` when neither is to be had. Requests
        entering in turn are served in that order."""
        if self.book.try_admit(request_id, kv_bytes):
            return Lease(self.book, request_id)
        return self.book.enqueue(request_id, kv_bytes)

    async def wait(self, request_id: int, waiter: Waiter) -> Lease:
        """Wait (at most `max_wait` seconds) for the slot of a request `enter` queued."""
        try:
            with trio.move_on_after(self.max_wait):
                await waiter.event.wait()
        except BaseException:
            # Cancelled while queued: leave the queue, or give back a slot granted meanwhile.
            self.leave(request_id, waiter)
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

    def leave(self, request_id: int, waiter: Waiter) -> None:
        """A queued request gives up: it leaves the queue, or gives back a slot granted
        meanwhile. Synchronous and idempotent."""
        if waiter.granted:
            self.book.release(request_id)
        else:
            self.book.leave_queue(request_id)
