"""Who owns an admitted request: the ASGI call of the HTTP request (or WebSocket session) that
admitted it.

A route admits a request (it holds an admission slot and is running on the runner) and then
returns a response whose streamed body reads its outputs. quart sends that body after the route
has returned, and an async generator that never started never runs its `finally`: a client that
went away between the admission and the body's first iteration (while the response's start was
being sent, say) would leave the slot held for good. So the slot's lifetime is not left to the
body: `RequestOwner` is ASGI middleware that opens a scope around the whole ASGI call, and every
`ActiveRequest` admitted inside it (`own`) is closed when that call ends, however it ends —
completed, failed, or cancelled because the client disconnected at any point of the response's
life. The body still closes its request as soon as the request is done; `close()` is idempotent,
so the scope's close is a no-op then.

The owner is found through a context variable that the middleware sets before it calls the app:
quart-trio's handler tasks are spawned inside that call, so they inherit it. Outside a request
(a test calling a route function directly) `own` owns nothing and returns the request as is.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from trio_mlx.actors.request import ActiveRequest

_current: ContextVar[OwnedRequests | None] = ContextVar("trio_mlx_owned_requests", default=None)


class OwnedRequests:
    """The requests admitted during one ASGI call; `close_all` ends those still open."""

    def __init__(self) -> None:
        self._requests: list[ActiveRequest] = []

    def add(self, active: ActiveRequest) -> None:
        # A WebSocket session admits one request per response: forget those already closed.
        self._requests = [r for r in self._requests if not r.closed]
        self._requests.append(active)

    def remove(self, active: ActiveRequest) -> None:
        self._requests = [r for r in self._requests if r is not active]

    def close_all(self) -> None:
        """Synchronous and idempotent: runs in `finally`, inside a cancelled scope too."""
        requests, self._requests = self._requests, []
        for active in requests:
            active.close()

    def __len__(self) -> int:
        return sum(1 for r in self._requests if not r.closed)


def own(active: ActiveRequest) -> ActiveRequest:
    """Tie `active` to the current ASGI call: it is closed when the call ends at the latest."""
    owned = _current.get()
    if owned is not None:
        owned.add(active)
    return active


def disown(active: ActiveRequest) -> ActiveRequest:
    """Untie `active` from the current ASGI call: its new owner (a background response,
    `responses/background.py`) closes it."""
    owned = _current.get()
    if owned is not None:
        owned.remove(active)
    return active


class RequestOwner:
    """ASGI middleware: each HTTP request and WebSocket session is the scope that owns the
    requests its routes admit (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        owned = OwnedRequests()
        reset = _current.set(owned)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(reset)
            owned.close_all()
