"""Cancellation is the abort path: a consumer that goes away frees the runner within one step.

Assertions are on the runner's own counters (steps, prefill chunks), never on wall time.
"""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
import trio

import trio_mlx
from idle import wait_until_idle
from servers import eventually

PROMPT = "In a hole in the ground there lived a hobbit."


@pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
async def test_cancelling_mid_decode_frees_the_runner_within_one_step(
    tiny_model_dir: Path, max_num_seqs: int
) -> None:
    # The serialized route counts its decode steps as `steps`; the batched route counts a loop
    # pass as a step even when it has nothing left to compute, so its `decode_steps` are counted.
    counter = "steps" if max_num_seqs == 1 else "decode_steps"
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=max_num_seqs) as engine:
        received = 0
        with trio.CancelScope() as scope:
            async for out in engine.stream_generate(PROMPT, max_tokens=900, temperature=0.0):
                received += len(out.new_tokens)
                if received >= 5:
                    scope.cancel()
        assert scope.cancelled_caught
        steps_at_abort = engine.get_stats()["runner"][counter]
        await wait_until_idle(engine)
        stats = engine.get_stats()
        assert stats["runner"][counter] <= steps_at_abort + 1
        assert stats["runner"]["aborted"] == 1
        assert stats["finished"] == {"abort": 1}
        # The next request is admitted at once (fail-fast mode would refuse it otherwise).
        again = await engine.generate(PROMPT, max_tokens=3, temperature=0.0)
        assert again.completion_tokens == 3


async def test_cancelling_mid_prefill_stops_between_chunks(tiny_model_dir: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, prefill_step_size=2) as engine:
        request = engine.prepare_generate([200 + i for i in range(600)], max_tokens=5)
        with trio.fail_after(10):
            async with engine.open_stream(request):
                while engine.get_stats()["runner"]["prefill_chunks"] < 3:  # noqa: ASYNC110
                    await trio.sleep(0.001)
        chunks_at_abort = engine.get_stats()["runner"]["prefill_chunks"]
        await wait_until_idle(engine)
        stats = engine.get_stats()
        assert stats["runner"]["prefill_chunks"] <= chunks_at_abort + 1 < 299
        assert stats["runner"]["generated_tokens"] == 0
        assert (await engine.generate(PROMPT, max_tokens=2)).finished


async def test_breaking_out_of_the_stream_aborts_the_request(engine: trio_mlx.Engine) -> None:
    async with aclosing(engine.stream_generate(PROMPT, max_tokens=900)) as outputs:
        async for _ in outputs:
            break
    await wait_until_idle(engine)
    stats = engine.get_stats()
    assert stats["runner"]["aborted"] == 1
    assert stats["runner"]["generated_tokens"] < 900


async def test_an_abandoned_stream_is_aborted_when_it_is_dropped(
    engine: trio_mlx.Engine,
) -> None:
    async for _ in engine.stream_generate(PROMPT, max_tokens=900):
        break
    # Dropping the stream object (no aclose) aborts the request and frees the slot.
    await wait_until_idle(engine)
    assert engine.get_stats()["runner"]["aborted"] == 1


async def test_a_timeout_on_a_non_streaming_call_aborts_it(engine: trio_mlx.Engine) -> None:
    def generating() -> bool:
        return bool(engine.get_stats()["runner"]["generated_tokens"])

    async def time_out(scope: trio.CancelScope) -> None:
        await eventually(generating)  # the deadline falls once tokens are coming
        scope.deadline = trio.current_time()

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            nursery.start_soon(time_out, scope)
            await engine.generate(PROMPT, max_tokens=900, temperature=0.0)
    assert scope.cancelled_caught
    await wait_until_idle(engine)
    stats = engine.get_stats()
    assert stats["runner"]["aborted"] == 1
    assert stats["runner"]["generated_tokens"] < 900


async def test_a_stop_string_stops_the_runner_without_waiting_for_the_consumer(
    engine: trio_mlx.Engine,
) -> None:
    free = await engine.generate(PROMPT, max_tokens=20, temperature=0.0)
    stop = free.text[len(free.text) // 3 :][:3]
    before = engine.get_stats()["runner"]["generated_tokens"]
    out = await engine.generate(PROMPT, max_tokens=900, temperature=0.0, stop=stop)
    assert out.finish_reason == "stop"
    await wait_until_idle(engine)
    generated = engine.get_stats()["runner"]["generated_tokens"] - before
    # At most a couple of tokens past the stop string (those already being computed).
    assert generated <= out.completion_tokens + 2
