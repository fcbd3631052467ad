"""An admitted request's handle, and the self-starting stream behind `stream_generate`.

`ActiveRequest.close()` undoes everything admission and submission did — the consumer's mailbox is
closed, the runner is told to abort, the admission slot is released — with synchronous, idempotent
calls, so it runs inside cancelled scopes, in `finally` blocks and from `__del__` alike.

`GenerationStream` is what `Engine.stream_generate` / `stream_chat` return: an async iterator that
is admitted on its first `__anext__`, releases its slot the moment it yields the final output, and
aborts the request if it is closed early (`aclose()`), cancelled, or simply dropped (garbage
collected after a `break`) — without the warning an abandoned async generator gets.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trio_mlx.actors.stream import RequestStream
from trio_mlx.types import GenerationOutput


class ActiveRequest:
    """A request that holds an admission slot and is (or was) running on the runner."""

    def __init__(self, stream: RequestStream, on_close: Callable[[RequestStream], None]) -> None:
        self.stream = stream
        self._on_close: Callable[[RequestStream], None] | None = on_close
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()

    @property
    def closed(self) -> bool:
        """Whether `close()` has run."""
        return self._on_close is None

    def close(self) -> None:
        """Abort (if still running) and release everything. Idempotent, synchronous."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self.stream)

    def close_from_any_thread(self) -> None:
        """`close()`, moved onto the Trio thread when called elsewhere (e.g. by the GC)."""
        if self._on_close is None:
            return
        if threading.get_ident() == self._thread:
            self.close()
            return
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self.close)


class GenerationStream:
    """Async iterator of `GenerationOutput`s that starts its request on first use."""

    def __init__(self, start: Callable[[], Awaitable[ActiveRequest]]) -> None:
        self._start: Callable[[], Awaitable[ActiveRequest]] | None = start
        self._active: ActiveRequest | None = None
        self._done = False

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._done:
            raise StopAsyncIteration
        if self._active is None:
            start, self._start = self._start, None
            assert start is not None
            try:
                self._active = await start()
            except BaseException:
                self._done = True
                raise
        try:
            output = await self._active.stream.__anext__()
        except BaseException:
            self._finish()
            raise
        if output.finished:
            self._finish()
        return output

    async def aclose(self) -> None:
        """Stop early: abort the request and free its slot."""
        self._finish()
        await trio.lowlevel.checkpoint()

    def _finish(self) -> None:
        self._done = True
        if self._active is not None:
            self._active.close()

    def __del__(self) -> None:
        active: Any = getattr(self, "_active", None)
        if active is not None:
            active.close_from_any_thread()
