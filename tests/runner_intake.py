"""Holding the runner thread before it reads its inbox, so that a test can queue several requests
and have the runner take them all at one step boundary (admitted together, prefilled together),
whatever the machine's load.

A `GatedModel` holds the runner inside a forward pass, after it has already taken the first
request: the others then arrive one step later, and on a busy machine the first may be decoding
(or done) before they join. `IntakeHold` holds it one step earlier, at the top of its loop, where
it applies its queued commands (the batched route's `batch_loop._apply`, the serialized route's
`serial_loop._take_commands`).
"""

from __future__ import annotations

import threading
from typing import Any

#: How long a held runner waits for the test at most (seconds): a test that forgets to open the
#: hold fails on its own assertions instead of hanging.
HOLD_LIMIT = 30.0


class IntakeHold:
    """While closed, the runner waits before applying its queued commands; `held` is set once it
    waits there. Open (the default) it does not wait."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.held = threading.Event()

    def close(self) -> None:
        self.held.clear()
        self.opened.clear()

    def open(self) -> None:
        self.opened.set()

    def wait_if_closed(self) -> None:
        """On the runner thread, before it reads its inbox."""
        if not self.opened.is_set():
            self.held.set()
            self.opened.wait(timeout=HOLD_LIMIT)


def hold_the_runner_intake(monkeypatch: Any) -> IntakeHold:
    """Install an `IntakeHold` (open) on both runner routes for the rest of the test."""
    from trio_mlx.actors import batch_loop, serial_loop

    hold = IntakeHold()
    apply, take = batch_loop._apply, serial_loop._take_commands

    def held_apply(runner: Any, batch: Any, *rest: Any) -> Any:
        hold.wait_if_closed()
        return apply(runner, batch, *rest)

    def held_take(runner: Any, live: Any, loaded: Any) -> Any:
        hold.wait_if_closed()
        return take(runner, live, loaded)

    monkeypatch.setattr(batch_loop, "_apply", held_apply)
    monkeypatch.setattr(serial_loop, "_take_commands", held_take)
    return hold
