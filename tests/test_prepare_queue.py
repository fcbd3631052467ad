"""The preparation worker (`actors/prepare_queue.py`): jobs run one at a time on a worker thread,
in the order they were queued, back to back without waiting for the event loop; `then` runs on
the Trio thread in the same order; a cancelled caller's job is dropped (unstarted) or its result
discarded (running)."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import trio
import trio.testing

from trio_mlx.actors.prepare_queue import PreparationQueue


class Gate:
    """Holds the job that calls `hold` until the test opens it (at most 10 s)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        assert self.opened.wait(10), "the test never opened the gate"


async def test_queued_jobs_run_back_to_back_in_order_without_the_event_loop() -> None:
    """Eight callers queue while the first job is held; once it is let go the worker runs all
    of them while the event loop is blocked (a job per `to_thread.run_sync` behind a limiter
    would need the loop between two jobs: this would time out). `then` sees them in order."""
    queue = PreparationQueue()
    gate = Gate()
    ran: list[int] = []
    threads: set[int] = set()
    thens: list[int] = []
    results: dict[int, int] = {}

    def work(i: int) -> int:
        if i == 0:
            gate.hold()
        ran.append(i)
        threads.add(threading.get_ident())
        return i

    def then(value: int) -> int:
        thens.append(value)
        return value * 10

    async def caller(i: int) -> None:
        results[i] = await queue.run(partial(work, i), then=then)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(caller, i)
                await trio.testing.wait_all_tasks_blocked()  # queued in this order
            await trio.to_thread.run_sync(gate.entered.wait)
            assert len(queue) == 7  # the first is running, seven wait
            gate.opened.set()
            deadline = time.monotonic() + 10
            while len(ran) < 8 and time.monotonic() < deadline:
                time.sleep(0.001)  # blocks the event loop on purpose
            assert ran == list(range(8))
    assert thens == list(range(8))
    assert results == {i: 10 * i for i in range(8)}
    assert len(threads) == 1
    assert queue.completed == 8


async def test_a_cancelled_caller_drops_its_queued_job_and_discards_a_running_one() -> None:
    queue = PreparationQueue()
    gate = Gate()
    ran: list[str] = []
    thens: list[str] = []

    def work(name: str) -> str:
        if name == "running":
            gate.hold()
        ran.append(name)
        return name

    def then(name: str) -> str:
        thens.append(name)
        return name

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running = trio.CancelScope()
            queued = trio.CancelScope()

            async def call(name: str, scope: trio.CancelScope) -> None:
                with scope:
                    await queue.run(partial(work, name), then=then)

            nursery.start_soon(call, "running", running)
            await trio.to_thread.run_sync(gate.entered.wait)
            nursery.start_soon(call, "queued", queued)
            await trio.testing.wait_all_tasks_blocked()
            queued.cancel()
            running.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert len(queue) == 0  # the queued job left the queue with its caller
            gate.opened.set()
            # The worker finishes the running job; the next one starts meanwhile.
            assert await queue.run(partial(work, "next"), then=then) == "next"
    assert ran == ["running", "next"]  # "queued" never ran
    assert thens == ["next"]  # the abandoned result went nowhere


async def test_errors_of_the_work_and_of_then_reach_the_caller() -> None:
    queue = PreparationQueue()

    def fails() -> int:
        raise ValueError("work failed")

    def refuses(value: int) -> int:
        raise LookupError(f"then refused {value}")

    with pytest.raises(ValueError, match="work failed"):
        await queue.run(fails, then=refuses)
    with pytest.raises(LookupError, match="then refused 3"):
        await queue.run(lambda: 3, then=refuses)
    assert await queue.run(lambda: 4) == 4  # the worker serves on
