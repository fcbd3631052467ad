"""A built decode step queued on the device after the tokens read before it are handed over
(`engine/dispatch_order.py`, `TRIO_MLX_DEFER_DISPATCH`): when it defers, and that deferring
changes no token, no abort and no companion of an aborted row."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import trio_mlx
from test_compiled_decode import _batched_script
from test_solo_row import LONG, SHORT, admit, alone, decoder
from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.dispatch_order import DEFER_DISPATCH_ENV, READY_SECONDS, DispatchOrder
from trio_mlx.engine.loading import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def test_auto_defers_while_the_reads_find_their_tokens_ready() -> None:
    order = DispatchOrder("auto")
    assert order.defer()  # no read yet: nothing says the device is behind
    order.observe(0.0)
    assert order.defer()
    order.observe(0.004)  # a read waited 4 ms: the device is the bottleneck
    assert not order.defer()
    for _ in range(3):
        order.observe(0.0)
        assert not order.defer()  # the average still remembers the wait
    for _ in range(10):
        order.observe(READY_SECONDS / 10)
    assert order.defer()
    assert order.deferred == 3


def test_on_and_off_ignore_the_waits_and_a_bad_mode_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    on, off = DispatchOrder("on"), DispatchOrder("off")
    for order in (on, off):
        order.observe(1.0)
    assert on.defer() and not off.defer()
    assert (on.deferred, off.deferred) == (1, 0)
    monkeypatch.delenv(DEFER_DISPATCH_ENV, raising=False)
    assert DispatchOrder().mode == "off"
    monkeypatch.setenv(DEFER_DISPATCH_ENV, "sometimes")
    with pytest.raises(ValueError, match=DEFER_DISPATCH_ENV):
        DispatchOrder()


def _pipelined(loaded: LoadedModel, mode: str) -> BatchDecoder:
    batch = decoder(loaded)
    batch.pipelined = True  # (the CPU reads each step at once by default)
    batch.dispatch_order = DispatchOrder(mode)
    return batch


def test_a_deferred_step_is_built_then_queued_and_gives_the_same_tokens(
    loaded: LoadedModel,
) -> None:
    """A lone row, a second joining, one leaving: each step `decode` builds stays off the
    device until `dispatch_pending` (or the next step) queues it; the tokens are the ones read
    with every step queued at once, and the lone row's are its own decode's."""
    streams: dict[str, dict[int, list[int]]] = {}
    for mode in ("off", "on"):
        batch = _pipelined(loaded, mode)
        tokens: dict[int, list[int]] = {}
        admit(batch, 1, LONG, 20)
        step = 0
        while batch.busy:
            if step == 4:
                admit(batch, 2, SHORT, 6)
            for result in batch.decode():
                assert result.error is None
                tokens.setdefault(result.seq.request_id, []).extend(result.tokens)
            queued = batch._queued
            if queued is not None:
                assert queued.dispatched == (mode == "off")
            if step % 2:  # as the runner's loop does after handing the tokens over
                batch.dispatch_pending()
                assert queued is None or queued.dispatched
            step += 1
        streams[mode] = tokens
        assert batch.dispatch_order.deferred == (0 if mode == "off" else batch.steps)
    assert streams["on"] == streams["off"]
    assert len(streams["on"][1]) == 20 and len(streams["on"][2]) == 6
    assert streams["on"][1] == alone(loaded, LONG, 20)


async def test_the_batched_route_gives_the_same_tokens_deferring(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine, pipelined: rows joining and leaving, one aborted mid-way (its
    companions unaffected), a prefix-cache hit; deferred steps counted in the stats."""
    monkeypatch.setenv("TRIO_MLX_BATCH_PIPELINE", "on")
    runs: dict[str, list[list[int]]] = {}
    for mode in ("on", "auto", "off"):
        monkeypatch.setenv(DEFER_DISPATCH_ENV, mode)
        async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
            runs[mode] = await _batched_script(engine)
            deferred = engine.get_stats()["runner"]["deferred_dispatches"]
        if mode != "auto":  # (auto defers as the waits go: some steps on the CPU)
            assert (deferred > 20) if mode == "on" else deferred == 0
    assert runs["on"] == runs["auto"] == runs["off"]
    assert [len(r) for r in runs["on"]] == [24, 40, 60, 12, 16]


async def test_a_client_leaving_mid_stream_leaves_the_engine_serving(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deferring, a stream cancelled between a step's hand-over and its queuing: the engine
    keeps serving the other stream and the next request."""
    monkeypatch.setenv("TRIO_MLX_BATCH_PIPELINE", "on")
    monkeypatch.setenv(DEFER_DISPATCH_ENV, "on")
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        kept: list[int] = []

        async def stays() -> None:
            out = await engine.generate(LONG, max_tokens=40, temperature=0.0)
            kept.extend(out.tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stays)
            with trio.move_on_after(30):
                got = 0
                async for out in engine.stream_generate(SHORT, max_tokens=400, temperature=0.0):
                    got += len(out.new_tokens)
                    if got >= 5:
                        break
        after = await engine.generate(SHORT, max_tokens=8, temperature=0.0)
    monkeypatch.setenv(DEFER_DISPATCH_ENV, "off")
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        expected = await engine.generate(LONG, max_tokens=40, temperature=0.0)
        expected_after = await engine.generate(SHORT, max_tokens=8, temperature=0.0)
    assert kept == list(expected.tokens)
    assert list(after.tokens) == list(expected_after.tokens)
