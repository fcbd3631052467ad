"""The Responses API's WebSocket mode: `GET /v1/responses` upgraded to a WebSocket.

The client sends `{"type": "response.create", ...}` messages, each with the fields of a
`POST /v1/responses` body (`stream` is implied and ignored); the server answers each with the
events of its stream (`stream.response_events`), one JSON message an event, one response at a
time. The connection keeps its most recent response (`store.ConnectionCache`), so that the
next `response.create` can continue it with `previous_response_id` and only its new input
items, `store: false` or not; a response stored on the server can be continued from any
connection.

A message that is not JSON, not an object, of another `type`, or a request refused before its
first event gets one `{"type": "error", "status", "error": {...}}` message (a failed turn, which
also drops the response it named from the connection's cache), and the connection stays open for
the next. A client that closes the socket aborts its response at the next step boundary, as an
HTTP client that goes away does; the response is not kept.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from pydantic import ValidationError
from quart import Websocket

from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.errors import APIError, from_validation_error, parse_json
from trio_mlx.http.responses.requests import ResponsesRequest
from trio_mlx.http.responses.run import start_response
from trio_mlx.http.responses.store import ConnectionCache
from trio_mlx.http.responses.stream import response_events
from trio_mlx.http.state import ServerState


async def serve_responses_socket(
    state: ServerState, socket: Websocket, record: RequestRecord
) -> None:
    """Accept the connection and answer its `response.create` messages until it closes."""
    await socket.accept()
    connection = ConnectionCache()
    while True:
        message = await socket.receive()
        try:
            body = socket_request(message)
            run = await start_response(state, body, record, connection)
        except APIError as exc:
            connection.evict(_named_previous(message))  # a failed turn: see `store`
            await socket.send(json.dumps(socket_error(exc)))
            continue
        async with contextlib.aclosing(response_events(run)) as batches:
            async for batch in batches:
                for _, data in batch:  # one message an event
                    await socket.send(data)


def socket_request(message: str | bytes) -> ResponsesRequest:
    """A `response.create` message as the request it carries; else a 400 `APIError`."""
    payload = parse_json(message, "message")
    if not isinstance(payload, dict):
        raise APIError(400, "a message must be a JSON object", code="invalid_json")
    kind = payload.pop("type", None)
    if kind != "response.create":
        raise APIError(
            400, f"unknown message type {kind!r}; expected 'response.create'", param="type"
        )
    payload.pop("stream", None)  # a WebSocket response is always streamed
    if payload.get("background"):
        raise APIError(
            400,
            "background mode is served by POST /v1/responses, not on the WebSocket",
            param="background",
        )
    try:
        return ResponsesRequest.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _named_previous(message: str | bytes) -> str | None:
    """The `previous_response_id` a refused message names, if it is readable."""
    try:
        payload = json.loads(message)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    named = payload.get("previous_response_id") if isinstance(payload, dict) else None
    return named if isinstance(named, str) else None


def socket_error(exc: APIError) -> dict[str, Any]:
    """The `error` event of a refused message: the error's status beside its body."""
    return {
        "type": "error",
        "status": exc.status,
        "error": {"type": exc.type, "code": exc.code, "message": exc.message, "param": exc.param},
    }
