"""The runner's hand-over to the Trio thread (`actors/handoff.py`): calls posted from another
thread run on the Trio thread in order, a burst shares one wake-up, nothing posted before the
last call is lost, a post after `close` is harmless, and the engine serves in both modes."""

from __future__ import annotations

import socket
import sys
import threading
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

import trio_mlx
from idle import wait_until_idle
from trio_mlx.actors.handoff import HANDOFF_ENV, Handoff


def _post_from_thread(
    handoff: Handoff, count: int, seen: list[tuple[int, int]]
) -> threading.Thread:
    def body() -> None:
        for i in range(count):
            handoff.post(lambda i=i: seen.append((i, threading.get_ident())))

    thread = threading.Thread(target=body)
    thread.start()
    return thread


@pytest.mark.parametrize("mode", ["hold", "trio"])
async def test_posts_from_a_thread_run_on_the_trio_thread_in_order(mode: str) -> None:
    handoff = Handoff(mode)
    assert handoff.mode == (mode if sys.platform != "win32" else "trio")
    seen: list[tuple[int, int]] = []
    done = trio.Event()
    thread = _post_from_thread(handoff, 500, seen)
    await trio.to_thread.run_sync(thread.join)
    handoff.post(done.set)  # the last post: serve_until returns once it has run
    with trio.fail_after(10):
        await handoff.serve_until(done)
    handoff.close()
    assert [i for i, _ in seen] == list(range(500))
    assert {ident for _, ident in seen} == {threading.get_ident()}


async def test_a_burst_of_posts_shares_one_wakeup() -> None:
    handoff = Handoff("hold")
    if handoff.mode != "hold":
        pytest.skip("libc's send is not reachable through ctypes on this platform")
    seen: list[tuple[int, int]] = []
    thread = _post_from_thread(handoff, 200, seen)
    await trio.to_thread.run_sync(thread.join)
    assert handoff.wakeups == 1  # nothing was served meanwhile: one wake-up on its way
    done = trio.Event()
    handoff.post(done.set)
    assert handoff.wakeups == 1
    with trio.fail_after(10):
        await handoff.serve_until(done)
    assert len(seen) == 200
    # served: the next post wakes the loop again
    again = trio.Event()
    handoff.post(again.set)
    assert handoff.wakeups == 2
    with trio.fail_after(10):
        await handoff.serve_until(again)
    handoff.close()


async def test_the_trio_mode_opens_no_socket_pair_and_the_hold_mode_closes_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[tuple[socket.socket, socket.socket]] = []
    real = socket.socketpair

    def recording_socketpair() -> tuple[socket.socket, socket.socket]:
        pair = real()
        made.append(pair)
        return pair

    monkeypatch.setattr(socket, "socketpair", recording_socketpair)
    Handoff("trio").close()
    assert made == []  # run_sync_soon needs no socket pair of ours
    held = Handoff("hold")
    assert len(made) == 1
    # where libc's send is out of reach the pair is closed at once; else it lives until close
    assert all(end.fileno() == -1 for end in made[0]) == (held.mode == "trio")
    held.close()
    assert all(end.fileno() == -1 for end in made[0])


async def test_a_post_after_close_runs_nowhere_and_writes_nothing() -> None:
    handoff = Handoff("hold")
    handoff.close()
    ran: list[int] = []
    handoff.post(ran.append, 1)  # must neither raise nor write to a closed descriptor
    await trio.sleep(0.01)
    assert ran == []
    assert handoff.wakeups == 0


async def test_an_unknown_mode_is_refused_with_the_variable_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(HANDOFF_ENV, "fast")
    with pytest.raises(ValueError, match=HANDOFF_ENV):
        Handoff()


@pytest.mark.parametrize("mode", ["hold", "trio"])
async def test_the_engine_streams_and_aborts_in_either_mode(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Both hand-overs through the real engine: a whole request's tokens, a stream left after
    two chunks (aborted, the engine idle again), then the same greedy tokens as before."""
    monkeypatch.setenv(HANDOFF_ENV, mode)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        whole = await engine.generate("hello there", max_tokens=12, temperature=0.0)
        chunks = 0
        async with aclosing(engine.stream_generate("hello there", max_tokens=900)) as outputs:
            async for _ in outputs:
                chunks += 1
                if chunks == 2:
                    break
        await wait_until_idle(engine)
        assert engine.get_stats()["runner"]["aborted"] == 1
        again = await engine.generate("hello there", max_tokens=12, temperature=0.0)
    assert whole.completion_tokens == 12
    assert again.tokens == whole.tokens
