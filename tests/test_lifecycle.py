"""Starting, failing and stopping: load errors, model faults, closing with requests in flight."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import trio_mlx
from model_wrappers import FaultyModel, break_the_runner_loop, wrapping_loader
from trio_mlx.actors.runner import RUNNER_THREAD_NAME
from trio_mlx.actors.runner_threads import IDLE_THREAD_NAME

PROMPT = "It was a bright cold day in April"


def runner_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == RUNNER_THREAD_NAME]


async def test_a_missing_model_raises_a_load_error_naming_it() -> None:
    with pytest.raises(trio_mlx.ModelLoadError, match="/no/such/model"):
        async with trio_mlx.open_engine("/no/such/model"):
            pytest.fail("the engine must not open")  # pragma: no cover


async def test_serve_engine_reports_the_engine_through_task_status(tiny_model_dir: Path) -> None:
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(trio_mlx.serve_engine, tiny_model_dir)
        assert (await engine.generate(PROMPT, max_tokens=2)).finished
        nursery.cancel_scope.cancel()
    assert not engine.is_alive


async def test_the_runner_thread_is_parked_when_the_engine_closes_and_serves_the_next(
    tiny_model_dir: Path,
) -> None:
    """The thread does not exit (MLX's thread-locals must not be torn down: `runner_threads`):
    it stops running the runner, parks, and the next engine runs on it."""
    async with trio_mlx.open_engine(tiny_model_dir) as engine:
        [thread] = runner_threads()
        await engine.generate(PROMPT, max_tokens=3)
    assert runner_threads() == []
    assert thread.is_alive() and thread.name == IDLE_THREAD_NAME
    with pytest.raises(trio_mlx.EngineClosed):
        await engine.generate(PROMPT, max_tokens=3)
    async with trio_mlx.open_engine(tiny_model_dir) as again:
        assert runner_threads() == [thread]
        assert (await again.generate(PROMPT, max_tokens=2)).finished


async def test_closing_the_engine_ends_streams_in_flight_with_abort(tiny_model_dir: Path) -> None:
    outputs: list[trio_mlx.GenerationOutput] = []
    got_some = trio.Event()

    async def consume(engine: trio_mlx.Engine) -> None:
        async for out in engine.stream_generate(PROMPT, max_tokens=900):
            outputs.append(out)
            got_some.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as outer:
            async with trio_mlx.open_engine(tiny_model_dir) as engine:
                outer.start_soon(consume, engine)
                await got_some.wait()
    assert outputs[-1].finished
    assert outputs[-1].finish_reason == "abort"
    assert outputs[-1].completion_tokens < 900
    assert runner_threads() == []


async def test_a_waiter_is_refused_when_the_engine_closes(tiny_model_dir: Path) -> None:
    errors: list[BaseException] = []

    async def wait_for_slot(engine: trio_mlx.Engine) -> None:
        request = engine.prepare_generate(PROMPT, max_tokens=2)  # so that it queues once blocked
        try:
            async with engine.open_stream(request):
                pass
        except trio_mlx.EngineClosed as exc:
            errors.append(exc)

    with trio.fail_after(20):
        async with trio.open_nursery() as outer:
            async with trio_mlx.open_engine(
                tiny_model_dir, max_num_seqs=1, max_waiting=1
            ) as engine:
                async with engine.open_stream(engine.prepare_generate(PROMPT, max_tokens=2)):
                    outer.start_soon(wait_for_slot, engine)
                    await trio.testing.wait_all_tasks_blocked()
                    assert engine.get_stats()["waiting"] == 1
                    engine.close()
    assert len(errors) == 1


async def test_the_callers_own_error_comes_out_unwrapped(tiny_model_dir: Path) -> None:
    with pytest.raises(KeyError):
        async with trio_mlx.open_engine(tiny_model_dir):
            raise KeyError("mine")
    assert runner_threads() == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
async def test_ctrl_c_and_sys_exit_in_the_block_come_out_unwrapped(
    tiny_model_dir: Path, error: type[BaseException]
) -> None:
    # Ctrl-C reaches a Trio program as KeyboardInterrupt in its main task, most likely while it
    # waits for a token inside the block. Wrapped in the engine nursery's BaseExceptionGroup,
    # `except KeyboardInterrupt` missed it (`trio-mlx generate` printed a traceback and exited
    # 1 instead of 130), and so did a `sys.exit()` in the block.
    with pytest.raises(error):
        async with trio_mlx.open_engine(tiny_model_dir) as engine:
            async for _ in engine.stream_generate(PROMPT, max_tokens=900):
                raise error()
    assert engine.get_stats()["finished"] == {"abort": 1}
    assert runner_threads() == []


async def test_a_model_fault_in_prefill_fails_that_request_only(tiny_model_dir: Path) -> None:
    poison = 31337
    loader, _ = wrapping_loader(lambda m: FaultyModel(m, poison=poison))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        with pytest.raises(trio_mlx.GenerationError, match="injected fault"):
            await engine.generate([5, 6, poison, 7, 8], max_tokens=4)
        out = await engine.generate(PROMPT, max_tokens=4)
        assert out.completion_tokens == 4
        stats = engine.get_stats()
        assert stats["runner"]["failed"] == 1
        assert stats["finished"] == {"error": 1, "length": 1}
        assert engine.is_alive


async def test_a_model_fault_mid_decode_ends_the_stream_with_an_error(tiny_model_dir: Path) -> None:
    loader, _ = wrapping_loader(lambda m: FaultyModel(m, poison=-1, fail_at_position=20))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        prompt = list(range(300, 310))
        outputs = [o async for o in engine.stream_generate(prompt, max_tokens=50)]
        assert outputs[-1].finish_reason == "error"
        assert "injected fault while decoding" in (outputs[-1].error or "")
        # The tokens generated before the fault were delivered.
        assert 0 < outputs[-1].completion_tokens < 50
        short = await engine.generate([1, 2, 3], max_tokens=3)
        assert short.completion_tokens == 3


@pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
async def test_a_dead_runner_thread_fails_requests_and_the_engine_says_so(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, max_num_seqs: int
) -> None:
    break_the_runner_loop(monkeypatch)
    with pytest.raises(trio_mlx.EngineCrashed, match="the runner loop itself broke"):
        async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=max_num_seqs) as engine:
            outputs = [o async for o in engine.stream_generate(PROMPT, max_tokens=50)]
            assert outputs[-1].finish_reason == "error"
            assert "crashed" in (outputs[-1].error or "")
            assert not engine.is_alive
            assert engine.get_stats()["alive"] is False
            with pytest.raises(trio_mlx.EngineCrashed):
                await engine.generate(PROMPT, max_tokens=2)
    assert runner_threads() == []


async def test_mlx_buffers_are_kept_between_requests_and_freed_once_idle(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Back-to-back requests reuse MLX's buffer cache (freeing and reallocating it costs
    # milliseconds per request on a GPU); an idle engine hands it back.
    import mlx.core as mx

    from trio_mlx.actors import runner

    monkeypatch.setattr(runner, "IDLE_TRIM_SECONDS", 1.0)
    async with trio_mlx.open_engine(tiny_model_dir, cache_memory_bytes=0) as engine:
        await engine.generate("Once upon a time", max_tokens=8, temperature=0.0)
        assert mx.get_cache_memory() > 0
        with trio.fail_after(10):
            while mx.get_cache_memory() > 0:  # noqa: ASYNC110 (MLX has no event to wait on)
                await trio.sleep(0.05)
        await engine.generate("Once upon a time", max_tokens=8, temperature=0.0)
        assert mx.get_cache_memory() > 0


async def test_a_model_load_cancelled_midway_returns_without_waiting_for_it(
    tiny_model_dir: Path,
) -> None:
    """The load (on the runner thread) cannot be interrupted; the caller is not kept waiting
    for it, and the thread drops the model and parks once the load ends."""
    from trio_mlx.engine.loading import load_model

    release = threading.Event()
    load_ended = threading.Event()

    def slow_loader(spec: str | Path | None) -> Any:
        try:
            release.wait(timeout=10)  # a load that lasts until the test ends it
            return load_model(spec)
        finally:
            load_ended.set()

    with trio.fail_after(8):
        with trio.move_on_after(0.5) as scope:
            async with trio_mlx.open_engine(tiny_model_dir, loader=slow_loader):
                pytest.fail("the engine cannot have opened")
    assert scope.cancelled_caught
    assert not load_ended.is_set()  # returned while the load was still running
    release.set()
    await trio.to_thread.run_sync(load_ended.wait)
    with trio.fail_after(10):
        while runner_threads():  # noqa: ASYNC110 (a thread's name has no event)
            await trio.sleep(0.01)


CTRL_C_DURING_LOAD = """
import os, signal, sys, time
from pathlib import Path
import trio
import trio_mlx
from trio_mlx.engine.loading import load_model

model, marker = sys.argv[1], Path(sys.argv[2])

def slow_loader(spec):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the model loads
    time.sleep(0.5)  # still loading when the caller has given up
    loaded = load_model(spec)
    marker.write_text("loaded")
    return loaded

async def main():
    async with trio_mlx.open_engine(model, loader=slow_loader):
        raise AssertionError("the engine cannot have opened")

try:
    trio.run(main)
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_during_the_load_comes_out_unwrapped_and_exit_waits_for_the_load(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Ctrl-C while the model loads came out of open_engine inside a BaseExceptionGroup
    # (`trio-mlx generate` printed a traceback). And the load, abandoned, goes on on its daemon
    # thread (as after any cancel: SIGINT / SIGTERM while `trio-mlx serve` loads): a process
    # that then ended tore the thread down inside the load, and inside MLX's C++ that killed
    # the process with SIGABRT ("terminate called without an active exception"). Exit now waits
    # for the load to end.
    marker = tmp_path / "loaded"
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_LOAD, str(tiny_model_dir), str(marker)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "interrupted\n"
    assert "terminate called" not in done.stderr
    assert marker.read_text() == "loaded"
