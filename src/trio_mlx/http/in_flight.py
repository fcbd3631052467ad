"""ASGI middleware that counts requests in flight, so that a draining server knows when it is done
(`CountInFlight`), and generation requests on their way to the engine (`NoteArrivals`).

A request counts from its first ASGI call until the app returns, which for a streamed response
is after its last byte (or after the client went away); a WebSocket counts until it closes.
`ServerState.wait_idle` returns when the count is zero. Nothing here refuses or cancels anything.
"""

from __future__ import annotations

from typing import Any

from trio_mlx.http.access_log import record_of
from trio_mlx.http.state import ServerState

#: the routes whose POST starts a generation
GENERATION_PATHS = frozenset(
    ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
)


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


class NoteArrivals:
    """ASGI middleware: a generation request is noted as on its way to the engine
    (`Engine.arriving`) from the moment its body has arrived until the route has it admitted or
    refused, so that the first arrivals of a burst on an idle engine wait, prefilled, for the
    rest of it before they decode (`batch_loop`). A body still being uploaded does not count:
    a slow client holds nobody."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        engine = self.state.engine
        if (
            engine is None
            or scope.get("type") != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        record = record_of(scope)

        async def receiving() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            if (
                record.arrival is None
                and message.get("type") == "http.request"
                and not message.get("more_body", False)
            ):
                record.arrival = engine.arriving()
            return message

        try:
            await self.app(scope, receiving, send)
        finally:
            if record.arrival is not None:
                record.arrival.done()
