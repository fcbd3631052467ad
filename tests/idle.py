"""The one "the engine is idle" check every test uses: what idle means, in one place."""

from __future__ import annotations

from typing import Any

import trio

from trio_mlx.actors.engine import Engine


def idle_problems(engine: Engine) -> list[str]:
    """What is still busy, from the engine's own state: admission (no slot held, nobody queued),
    the runner (no live sequence, no request in flight on the Trio side, i.e. no sink left, none
    noted as on its way), the preparation worker (nothing queued). Empty when the engine is
    idle."""
    stats = engine.get_stats()
    runner = stats["runner"]
    problems = []
    if stats["running"]:
        problems.append(f"{stats['running']} admission slot(s) held: {stats['slot_holders']}")
    if stats["waiting"]:
        problems.append(f"{stats['waiting']} request(s) queued for admission")
    if runner["live_sequences"]:
        problems.append(f"{runner['live_sequences']} live sequence(s) on the runner")
    if runner["requests_in_flight"]:
        problems.append(f"{runner['requests_in_flight']} request(s) in flight (sinks held)")
    if runner["arriving"]:
        problems.append(f"{runner['arriving']} request(s) still noted as on their way")
    if stats["preparing"]:
        problems.append(f"{stats['preparing']} request(s) queued for preparation")
    return problems


async def wait_until_idle(engine: Engine, limit: float = 10.0) -> dict[str, Any]:
    """The engine's stats once it is idle (`idle_problems` empty); fails after `limit` seconds
    with what was still busy. Polls: the runner's live count is written by its own thread."""
    problems: list[str] = []
    with trio.move_on_after(limit):
        # Polled: the runner's live count is written by its own thread, not signalled.
        while problems := idle_problems(engine):  # noqa: ASYNC110
            await trio.sleep(0.002)
    assert not problems, f"the engine is not idle after {limit} s: {'; '.join(problems)}"
    return engine.get_stats()
