"""The runner thread's hand-over to the Trio thread: callbacks run there in order, the event loop
woken without the runner thread giving its GIL away.

Why: `TrioToken.run_sync_soon` wakes the event loop by writing to Trio's wake-up socket with
`socket.send`, which releases the GIL. The Trio thread, just woken from `epoll`, takes it at once
and runs a step's deliveries (the sinks, the stream actors' detokenizing and stop matching, the
SSE chunks) while the runner thread waits to take the GIL back before it can build the next step:
on the 2-core CPU the runner thread spent ~190 µs a token inside `run_sync_soon` (cProfile of the
thread). Written with a GIL-holding `send` (libc's, called through `ctypes.PyDLL`, which keeps
the GIL), the wake-up costs the runner thread a system call only; the Trio thread wakes and waits
for the GIL until the runner thread releases it in MLX's dispatch of the next step (`mx.eval` /
`mx.async_eval` release the GIL), so the deliveries overlap the dispatch instead of delaying the
build. A waiting Trio thread asks for the GIL after the interpreter's switch interval
(`EngineConfig.gil_switch_interval`), so a token is never held longer than that.

Measured (docs/benchmarks, "The runner's hand-over to Trio"): alone, on a loop shaped like a GPU
decode step (`bench.handoff`), the runner keeps 97-99% of its bare steps/s against 91-94% with
`run_sync_soon`; through the server on an H100 (1B bf16, `bench.token_path`, noisy host) one
stream's tokens/s over `run_sync_soon`'s was 1.27x in the median of 11 back-to-back pairs
(quartiles 0.90-1.47), eight streams' 0.99x (0.93-1.09); on the CPU, where MLX's evaluation of a
step takes most of it with the GIL released, level.

What: `Handoff.post(fn, *args)` (runner thread) queues a call and, unless a wake-up is already on
its way, writes one byte to a socket pair of our own; the runner's Trio task waits in
`Handoff.serve_until(finished)`, which runs every queued call in order (`run_posted`) each time
the socket is readable, until the runner thread's last post (`finished.set`) has run: nothing
posted is lost, and the order is the order of posting. Calls posted in one burst share one
wake-up. `TRIO_MLX_HANDOFF=trio` (or a platform without libc's `send` through ctypes) hands over
with `TrioToken.run_sync_soon` instead, as before; `hold` is the default.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["HANDOFF_ENV", "Handoff", "gil_holding_send"]

#: Environment switch: `hold` (the default: our own wake-up, GIL held) or `trio` (run_sync_soon).
HANDOFF_ENV = "TRIO_MLX_HANDOFF"

_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def gil_holding_send(fd: int) -> Callable[[], None] | None:
    """A call that writes one byte to socket `fd` without releasing the GIL (libc's `send`
    through `ctypes.PyDLL`), never blocking (a full socket already wakes its reader: the write is
    dropped); None where libc's `send` cannot be reached this way."""
    if not _MSG_DONTWAIT:
        return None
    try:
        send = ctypes.PyDLL(None).send
    except (OSError, AttributeError):
        return None
    send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    send.restype = ctypes.c_ssize_t
    byte = b"\x00"

    def wake() -> None:
        send(fd, byte, 1, _MSG_DONTWAIT)

    return wake


class Handoff:
    """Calls from the runner thread to the Trio thread (module docstring). Make it on the Trio
    thread; `serve_until` runs the calls while a Trio task waits in it; `close` when done."""

    def __init__(self, mode: str | None = None) -> None:
        if mode is None:
            mode = os.environ.get(HANDOFF_ENV, "").strip().lower() or "hold"
        if mode not in ("hold", "trio"):
            raise ValueError(f"{HANDOFF_ENV} must be hold or trio, not {mode!r}")
        self._token = trio.lowlevel.current_trio_token()
        self._calls: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        #: a wake-up is on its way: a post adds to the queue and writes nothing
        self._pending = False
        #: the wake-up's socket pair and its GIL-keeping write (`hold` only; None in `trio` mode)
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._wake: Callable[[], None] | None = None
        if mode == "hold":
            reader, writer = socket.socketpair()
            wake = gil_holding_send(writer.fileno())
            if wake is None:  # libc's send out of reach: run_sync_soon after all
                reader.close()
                writer.close()
            else:
                reader.setblocking(False)
                writer.setblocking(False)
                self._reader, self._writer, self._wake = reader, writer, wake
        #: held while the writer's descriptor is written or closed: a late post after `close`
        #: must not write to a descriptor number the process may have given to another file
        self._closing = threading.Lock()
        self._closed = False
        #: `hold` when the wake-up keeps the GIL, `trio` when posts go through run_sync_soon
        self.mode = "hold" if self._wake is not None else "trio"
        #: wake-ups written (a burst of posts shares one)
        self.wakeups = 0

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Runner thread: have `fn(*args)` run on the Trio thread, after everything posted
        before it. Never blocks, never waits for the event loop."""
        wake = self._wake
        if wake is None:
            self._token.run_sync_soon(fn, *args)
            return
        self._calls.append((fn, args))
        if not self._pending:
            self._pending = True
            with self._closing:
                if not self._closed:
                    self.wakeups += 1
                    wake()

    def run_posted(self) -> None:
        """Trio thread: run every call posted so far, in order."""
        self._pending = False  # before the reads: a post from here on writes a wake-up
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            fn(*args)

    async def serve_until(self, done: trio.Event) -> None:
        """Run posted calls as their wake-ups arrive, until one of them has set `done` (the
        runner thread's last post: everything posted before it has run)."""
        reader = self._reader
        if reader is None:  # posts go through run_sync_soon
            await done.wait()
            return
        while not done.is_set():
            await trio.lowlevel.wait_readable(reader)
            with contextlib.suppress(BlockingIOError):
                while reader.recv(4096):
                    pass
            self.run_posted()

    def close(self) -> None:
        """Close the socket pair (if any); a later post runs nowhere (and writes nothing)."""
        with self._closing:
            self._closed = True
            for end in (self._reader, self._writer):
                if end is not None:
                    end.close()
