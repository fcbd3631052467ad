"""The Responses API's WebSocket mode: `GET /v1/responses` upgraded to a WebSocket.

The client sends `{"type": "response.create", ...}` messages, each with the fields of a
`POST /v1/responses` body (`stream` is implied and ignored); the server answers each with the
events of its stream (`stream.response_events`), one JSON message an event. A message may name
a lane, `stream_id` (WebSocket-only): each lane serves its responses one at a time, in order,
the lanes concurrently, and every event of a lane's response, its `error` events included,
carries its `stream_id` (`socket_lanes`, which also bounds them). Messages without `stream_id`
share the default lane, one response at a time, and their events carry no `stream_id`.

The connection keeps each lane's most recent response (`store.ConnectionCache`), so that the
next `response.create`, on any lane, can continue it with `previous_response_id` and only its
new input items, `store: false` or not (a new lane can fork from another lane's response); a
response stored on the server can be continued from any connection.

A message that is not JSON, not an object, of another `type`, or a request refused before its
first event gets one `{"type": "error", "status", "error": {...}}` message (a failed turn, which
also drops the response it named from the connection's cache), and the connection stays open for
the next; other lanes are not disturbed. A message whose lane cannot be read (not JSON, not an
object, a `stream_id` that is no non-empty string of at most `MAX_STREAM_ID` characters) is
answered on the default lane, in its order. A client that closes the socket aborts every lane's
response at the next step boundary, as an HTTP client that goes away does; they are not kept.
"""

from __future__ import annotations

import contextlib
from typing import Any

import trio
from pydantic import ValidationError
from quart import Websocket

from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.errors import APIError, from_validation_error, parse_json
from trio_mlx.http.generation import json_text
from trio_mlx.http.responses.requests import ResponsesRequest
from trio_mlx.http.responses.run import start_response
from trio_mlx.http.responses.socket_lanes import (
    MAX_STREAM_ID,
    Outbox,
    SocketLanes,
    lane_tail,
    tagged,
)
from trio_mlx.http.responses.store import ConnectionCache, LaneCache
from trio_mlx.http.responses.stream import response_events
from trio_mlx.http.state import ServerState


async def serve_responses_socket(
    state: ServerState, socket: Websocket, record: RequestRecord
) -> None:
    """Accept the connection and answer its `response.create` messages until it closes."""
    await socket.accept()
    connection = ConnectionCache()
    outbox = Outbox(socket)

    async def serve(stream_id: str | None, item: Message) -> None:
        await serve_message(state, record, connection.lane(stream_id), outbox, item)

    async with trio.open_nursery() as nursery:  # cancelled when the client goes away
        lanes = SocketLanes(nursery, serve)
        while True:
            stream_id, item = read_message(await socket.receive())
            refused = await lanes.route(stream_id, item)
            if refused is not None:
                await outbox.send([tagged(json_text(socket_error(refused)), lane_tail(stream_id))])


#: A message as its lane serves it: its fields, or why it could not be read.
Message = dict[str, Any] | APIError


async def serve_message(
    state: ServerState, record: RequestRecord, cache: LaneCache, outbox: Outbox, item: Message
) -> None:
    """Answer one message of a lane: its response's events, or one `error` event."""
    tail = lane_tail(cache.stream_id)
    try:
        if isinstance(item, APIError):
            raise item
        run = await start_response(state, socket_request(item), record, cache)
    except APIError as exc:
        cache.evict(_named_previous(item))  # a failed turn: see `store`
        await outbox.send([tagged(json_text(socket_error(exc)), tail)])
        return
    async with contextlib.aclosing(response_events(run)) as batches:
        async for batch in batches:  # one message an event, a batch at once
            await outbox.send([tagged(data, tail) for _, data in batch])


def read_message(message: str | bytes) -> tuple[str | None, Message]:
    """A message's lane (its `stream_id`, None: the default lane) and its fields without
    `stream_id`; a message that cannot be read, or names no valid lane, is the default lane's
    `APIError`."""
    try:
        payload = parse_json(message, "message")
    except APIError as exc:
        return None, exc
    if not isinstance(payload, dict):
        return None, APIError(400, "a message must be a JSON object", code="invalid_json")
    stream_id = payload.pop("stream_id", None)
    if stream_id is not None and not (
        isinstance(stream_id, str) and 0 < len(stream_id) <= MAX_STREAM_ID
    ):
        return None, APIError(
            400,
            f"stream_id must be a non-empty string of at most {MAX_STREAM_ID} characters",
            param="stream_id",
        )
    return stream_id, payload


def socket_request(payload: dict[str, Any]) -> ResponsesRequest:
    """A `response.create` message's fields as the request it carries; else a 400
    `APIError`."""
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


def _named_previous(item: Message) -> str | None:
    """The `previous_response_id` a refused message names, if it is readable."""
    named = item.get("previous_response_id") if isinstance(item, dict) else None
    return named if isinstance(named, str) else None


def socket_error(exc: APIError) -> dict[str, Any]:
    """The `error` event of a refused message: the error's status beside its body."""
    return {
        "type": "error",
        "status": exc.status,
        "error": {"type": exc.type, "code": exc.code, "message": exc.message, "param": exc.param},
    }
