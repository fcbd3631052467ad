"""The lanes of a Responses WebSocket: `stream_id`, and the one sender of the connection.

A `response.create` may name a lane (`stream_id`, a WebSocket-only field). Each lane serves its
messages in order, one at a time (FIFO), and the lanes of a connection run concurrently: their
generations batch in the engine as any concurrent requests do. Messages without `stream_id` go
to the default lane (key None), which is what the connection was before lanes: one response at
a time, in order.

Structure: the connection's nursery holds the receive loop (`socket.serve_responses_socket`)
and a task per live lane, fed by a bounded memory channel. A lane's task is started by the
first message for its `stream_id` and ends when it has nothing left to serve, so that a lane
costs nothing while idle and a later message with the same `stream_id` opens it again (the
connection's cache still holds the lane's most recent response, `store.ConnectionCache`).

Bounds (`route` refuses beyond them, with an `APIError` the caller sends as an `error` event
naming the `stream_id`, at once, not in the lane's order):

- `MAX_LANES` lanes with a `stream_id` live at once (serving or holding messages), besides the
  default lane;
- `MAX_QUEUED` messages waiting in a lane behind the one it serves. The default lane is not
  refused: its messages wait for room, the receive loop with them (backpressure, as before
  lanes, when the connection read its next message only after a response had ended).

A refused message is no failed turn: the response it names stays in the connection's cache, for
the client to send it again when there is room.

A connection's messages go out whole through its `Outbox`, one batch at a time: a lane's batch
of events (`stream.response_events`) is written together, never interleaved with another lane's
messages. (The server stack would keep each message whole on its own, hypercorn writes a frame
under its own lock; the outbox makes the order of whole batches ours and not its detail.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from json.encoder import encode_basestring_ascii
from typing import Generic, TypeVar

import trio
from quart import Websocket

from trio_mlx.http.errors import OVERLOADED, APIError

#: Lanes with a `stream_id` live at once on one connection (the default lane besides).
MAX_LANES = 16
#: Messages that wait in one lane behind the one it serves.
MAX_QUEUED = 8
#: The longest `stream_id` taken (it is kept, and echoed in every event of its lane).
MAX_STREAM_ID = 256

Item = TypeVar("Item")


class Outbox:
    """The connection's sending side: one batch of messages at a time, each message whole."""

    def __init__(self, socket: Websocket) -> None:
        self._socket = socket
        self._lock = trio.Lock()  # fair: waiting lanes take turns, batch by batch

    async def send(self, messages: Iterable[str]) -> None:
        async with self._lock:
            for message in messages:
                await self._socket.send(message)


def lane_tail(stream_id: str | None) -> str | None:
    """What a lane's events end with instead of their closing brace, `,"stream_id":"…"}`
    (every event is a JSON object); None on the default lane, whose events are left as they
    are."""
    if stream_id is None:
        return None
    return f',"stream_id":{encode_basestring_ascii(stream_id)}}}'


def tagged(event: str, tail: str | None) -> str:
    """An event's JSON text (compact, ending with its closing brace) with its lane's
    `stream_id` as its last field (`lane_tail`)."""
    return event if tail is None else event[:-1] + tail


class _Lane(Generic[Item]):
    def __init__(self, stream_id: str | None) -> None:
        self.stream_id = stream_id
        # Room for the one served (until its task takes it) and the ones waiting behind it.
        self.send, self.receive = trio.open_memory_channel[Item](MAX_QUEUED + 1)
        #: Messages routed here and not yet served to their end, the one being served included.
        self.pending = 0


class SocketLanes(Generic[Item]):
    """A connection's live lanes, their tasks in `nursery`; `serve(stream_id, item)` serves one
    message of a lane to its end (errors included: an exception it raises ends the
    connection)."""

    def __init__(
        self, nursery: trio.Nursery, serve: Callable[[str | None, Item], Awaitable[None]]
    ) -> None:
        self._nursery = nursery
        self._serve = serve
        self._lanes: dict[str | None, _Lane[Item]] = {}

    @property
    def named(self) -> int:
        """How many lanes with a `stream_id` are live."""
        return len(self._lanes) - (None in self._lanes)

    async def route(self, stream_id: str | None, item: Item) -> APIError | None:
        """Queue `item` on its lane, opening the lane if it is not live; the refusal, if a
        bound refuses it (see the module docstring)."""
        lane = self._lanes.get(stream_id)
        if lane is None:
            if stream_id is not None and self.named >= MAX_LANES:
                return _refusal(
                    f"too many lanes: at most {MAX_LANES} stream_id lanes are live at once on "
                    f"a connection; stream_id {stream_id!r} was not opened",
                    "too_many_lanes",
                )
            lane = self._lanes[stream_id] = _Lane(stream_id)
            self._nursery.start_soon(self._run, lane)
        elif stream_id is not None and lane.pending > MAX_QUEUED:
            return _refusal(
                f"lane {stream_id!r} is full: at most {MAX_QUEUED} messages wait behind the "
                "response it is serving",
                "lane_queue_full",
            )
        lane.pending += 1
        if stream_id is None:
            await lane.send.send(item)  # the default lane waits for room
        else:
            lane.send.send_nowait(item)  # room is there: `pending` is counted first
        return None

    async def _run(self, lane: _Lane[Item]) -> None:
        """Serve a lane's messages in order; end it once none is left."""
        try:
            with lane.receive:
                while lane.pending:
                    item = await lane.receive.receive()
                    try:
                        await self._serve(lane.stream_id, item)
                    finally:
                        lane.pending -= 1
        finally:
            # No checkpoint since `pending` was read as 0: no message can be on its way here.
            if self._lanes.get(lane.stream_id) is lane:
                del self._lanes[lane.stream_id]
            lane.send.close()


def _refusal(message: str, code: str) -> APIError:
    return APIError(429, message, type=OVERLOADED, param="stream_id", code=code)
