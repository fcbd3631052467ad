"""ASGI middleware that counts requests in flight, so that a draining server knows when it is done.

A request counts from its first ASGI call until the app returns, which for a streamed response
is after its last byte (or after the client went away); a WebSocket counts until it closes.
`ServerState.wait_idle` returns when the count is zero. Nothing here refuses or cancels anything.
"""

from __future__ import annotations

from typing import Any

from trio_mlx.http.state import ServerState


class CountInFlight:
    """Wraps an ASGI app; `state.in_flight` is the number of its HTTP/WebSocket calls running."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        self.state.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.request_ended()
