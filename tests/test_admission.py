"""Admission: the serialized route, fail-fast refusals and the bounded waiting queue."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

import trio_mlx
from servers import eventually
from trio_mlx.actors.admission import AdmissionBook

PROMPT = "Once upon a time"


# ---- the book, without Trio's scheduler --------------------------------------------------------


def test_book_grants_one_slot_then_refuses_in_fail_fast_mode() -> None:
    book = AdmissionBook(slots=1, mode="fail-fast")
    assert book.try_admit(1)
    assert not book.try_admit(2)
    with pytest.raises(trio_mlx.EngineBusy):
        book.enqueue(2)
    assert book.statistics().busy_rejections == 1
    book.release(1)
    assert book.try_admit(3)


def test_book_hands_a_released_slot_to_the_first_waiter_in_order() -> None:
    book = AdmissionBook(slots=1, mode="wait", max_waiting=2)
    assert book.try_admit(1)
    w2, w3 = book.enqueue(2), book.enqueue(3)
    with pytest.raises(trio_mlx.EngineBusy):
        book.enqueue(4)
    # A newcomer cannot overtake the queue even when it finds the slot free.
    book.release(1)
    assert w2.granted and not w3.granted
    assert not book.try_admit(5)
    book.release(2)
    assert w3.granted
    assert book.statistics().running == 1 and book.statistics().waiting == 0


def test_book_release_is_idempotent() -> None:
    book = AdmissionBook(slots=1, mode="wait", max_waiting=1)
    book.try_admit(1)
    waiter = book.enqueue(2)
    book.release(1)
    book.release(1)
    assert waiter.granted
    assert book.statistics().running == 1


# ---- through the engine: one slot (`max_num_seqs=1`, the serialized route) ---------------------


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[trio_mlx.Engine]:
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        yield engine


async def test_a_second_request_fails_fast_while_the_first_holds_the_slot(
    engine: trio_mlx.Engine,
) -> None:
    first = engine.prepare_generate(PROMPT, max_tokens=3)
    async with engine.open_stream(first) as stream:
        with pytest.raises(trio_mlx.EngineBusy) as info:
            await engine.generate(PROMPT, max_tokens=3)
        assert info.value.retry_after >= 1
        async for _ in stream:
            pass
    stats = engine.get_stats()
    assert stats["busy_rejections"] == 1
    assert stats["admission_mode"] == "fail-fast"
    # Once released, the slot is free at once.
    out = await engine.generate(PROMPT, max_tokens=3)
    assert out.finished


async def test_waiting_requests_are_served_in_order_and_a_full_queue_refuses(
    tiny_model_dir: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1, max_waiting=2) as engine:
        order: list[str] = []
        release = trio.Event()

        async def holder() -> None:
            async with engine.open_stream(engine.prepare_generate(PROMPT, max_tokens=2)) as s:
                async for _ in s:
                    pass
                await release.wait()
            order.append("a")

        async def waiter(name: str) -> None:
            # Prepared here, synchronously: the task is queued for admission once it blocks.
            async with engine.open_stream(engine.prepare_generate(PROMPT, max_tokens=2)) as s:
                async for _ in s:
                    pass
            order.append(name)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(holder)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(waiter, "b")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(waiter, "c")
                await trio.testing.wait_all_tasks_blocked()
                stats = engine.get_stats()
                assert (stats["running"], stats["waiting"]) == (1, 2)
                with pytest.raises(trio_mlx.EngineBusy):
                    await engine.generate(PROMPT, max_tokens=2)
                release.set()
        assert order == ["a", "b", "c"]
        assert engine.get_stats()["busy_rejections"] == 1


async def test_a_waiter_whose_deadline_passes_is_refused_and_leaves_the_queue(
    tiny_model_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=1, max_waiting=1, max_wait=5.0
    ) as engine:
        async with engine.open_stream(engine.prepare_generate(PROMPT, max_tokens=2)) as stream:
            async for _ in stream:
                pass
            started = trio.current_time()
            with pytest.raises(trio_mlx.EngineBusy) as info:
                await engine.generate(PROMPT, max_tokens=2)
            assert info.value.reason == "timeout"
            assert trio.current_time() - started == pytest.approx(5.0)
            stats = engine.get_stats()
            assert (stats["waiting"], stats["wait_timeouts"]) == (0, 1)
        assert (await engine.generate(PROMPT, max_tokens=2)).finished


async def test_a_cancelled_waiter_leaves_the_queue_without_taking_the_slot(
    tiny_model_dir: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1, max_waiting=1) as engine:
        async with engine.open_stream(engine.prepare_generate(PROMPT, max_tokens=2)) as stream:

            async def cancel_once_queued(waiter: trio.CancelScope) -> None:
                await eventually(lambda: engine.get_stats()["waiting"] == 1)
                waiter.cancel()

            async with trio.open_nursery() as nursery:
                with trio.CancelScope() as waiter:
                    nursery.start_soon(cancel_once_queued, waiter)
                    await engine.generate(PROMPT, max_tokens=2)
            assert waiter.cancelled_caught  # cancelled while it waited in the queue
            assert engine.get_stats()["waiting"] == 0
            async for _ in stream:
                pass
        stats = engine.get_stats()
        assert (stats["running"], stats["waiting"]) == (0, 0)
        assert (await engine.generate(PROMPT, max_tokens=2)).finished
