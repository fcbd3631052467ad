"""The access log: one line per request, in the usual combined-log spirit, with tokens and timing.

    127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 1.234s model=m prompt=12 completion=30
        ttft=0.021s finish=stop

It is ASGI middleware: it sees the status when the response starts and writes the line when the
response ends, the client disconnects, or the handler fails, so streamed responses are logged
with their real duration. Routes add what they know to the request's `RequestRecord`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from trio_mlx.actors.engine import Arrival
from trio_mlx.types import GenerationOutput

log = logging.getLogger("trio_mlx.access")

RECORD_KEY = "trio_mlx.record"


@dataclass
class RequestRecord:
    """What a route learned about a request, for its log line."""

    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    time_to_first_token: float | None = None
    finish_reason: str | None = None
    #: the request noted as on its way to the engine (`in_flight.NoteArrivals`)
    arrival: Arrival | None = None

    def finish(self, last: GenerationOutput | None) -> None:
        """Note how a generation ended (`last` is its last output; None: it never started)."""
        self.finish_reason = "abort"
        if last is not None:
            self.completion_tokens = last.completion_tokens
            self.time_to_first_token = last.time_to_first_token
            if last.finished and last.finish_reason is not None:
                self.finish_reason = last.finish_reason


def record_of(scope: Any) -> RequestRecord:
    """The record of the request whose ASGI scope is `scope` (created on first use)."""
    record = scope.get(RECORD_KEY)
    if record is None:
        record = scope[RECORD_KEY] = RequestRecord()
    assert isinstance(record, RequestRecord)
    return record


class AccessLog:
    """Wraps an ASGI app; logs each HTTP request and WebSocket session once, when it ends, and
    hands the request's record to `on_end` (the metrics)."""

    def __init__(self, app: Any, on_end: Callable[[RequestRecord, float], None]) -> None:
        self.app = app
        self.on_end = on_end

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: list[int] = []

        def logged_send(message: dict[str, Any]) -> Awaitable[None]:
            # Returns `send`'s awaitable: no frame of its own on every body chunk's send.
            kind = message["type"]
            if kind == "http.response.body":
                return send(message)  # type: ignore[no-any-return]
            if kind == "http.response.start":
                status.append(int(message["status"]))
            elif kind == "websocket.accept":
                status.append(101)
            elif kind == "websocket.http.response.start":  # refused before the handshake
                status.append(int(message["status"]))
            elif kind == "websocket.close" and not status:
                status.append(403)
            return send(message)  # type: ignore[no-any-return]

        try:
            await self.app(scope, receive, logged_send)
        finally:
            elapsed = time.perf_counter() - started
            _write(scope, status[0] if status else 499, elapsed)
            record = scope.get(RECORD_KEY)
            if record is not None:
                self.on_end(record, elapsed)


def _write(scope: dict[str, Any], status: int, elapsed: float) -> None:
    client = scope.get("client") or ("-", 0)
    method = scope.get("method", "WS")
    version = scope.get("http_version", "1.1")
    line = f'{client[0]} "{method} {scope.get("path", "")} HTTP/{version}" {status} {elapsed:.3f}s'
    record: RequestRecord | None = scope.get(RECORD_KEY)
    if record is not None:
        if record.model is not None:
            line += f" model={record.model}"
        if record.prompt_tokens is not None:
            line += f" prompt={record.prompt_tokens}"
        if record.completion_tokens is not None:
            line += f" completion={record.completion_tokens}"
        if record.time_to_first_token is not None:
            line += f" ttft={record.time_to_first_token:.3f}s"
        if record.finish_reason is not None:
            line += f" finish={record.finish_reason}"
    log.info(line)
