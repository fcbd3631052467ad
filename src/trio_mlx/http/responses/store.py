"""Responses kept for later turns: the Responses API's `store` and `previous_response_id`.

A response is kept when its generation ends `completed` or `incomplete` (before its last event
is sent, so that a client that read it can continue at once), as a `StoredResponse`: its object
as the client got it, its input items as the conversation resolved them (the previous
response's input and output items, then its own, each with an `id`), and its output items. A
`failed` response (a generation error, the server's shutdown) is not kept: its output is cut at
an arbitrary step and a later turn would continue a reply the model never finished. Nor is a
response whose client went away before it ended: its generation was aborted, it has no end.

Two places keep them, both in memory:

- `ResponseStore`, the server's: the responses of requests with `store` true (the default, as at
  OpenAI), for `previous_response_id` over HTTP and WebSocket, `GET` and `DELETE
  /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`. Bounded by count and by bytes
  (`--response-store-size`, `--response-store-mb`), the oldest evicted first; a bound of 0 keeps
  nothing. A response's bytes are the JSON length of its object and of its items, the earlier
  turns' items included: a chain's items, shared by reference between its turns, count once for
  each turn that holds them, so the count only overstates what the items' text takes. (Their
  Python objects take a few times their JSON length.)
- `ConnectionCache`, one WebSocket connection's: each lane's most recent response (`stream_id`,
  `socket_lanes`; the default lane's too), kept whether `store` is true or false (OpenAI's
  connection-local cache, which makes the WebSocket mode work with `store: false`); any lane's
  response can be continued from any lane of the connection (a fork). At most
  `CACHED_LANES` lanes' responses, the lane that kept one least recently dropped first. A turn
  that fails (refused, or its generation failed) drops the response it named from the cache,
  as OpenAI's does, so that a retry does not continue from stale state; the server's store,
  where the response is stored too, still has it.

Everything runs on the Trio thread: no locks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trio_mlx.bounded_map import BoundedMap
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import json_text

#: `--response-store-size` and `--response-store-mb` by default.
DEFAULT_RESPONSES = 1000
DEFAULT_MEGABYTES = 256.0


@dataclass(frozen=True)
class StoredResponse:
    """A response as a later turn and the retrieval routes need it. The item dicts are shared
    with the turns that continue it and must not be changed."""

    id: str
    #: The response object, as its last event (or the whole response) carried it.
    response: dict[str, Any]
    #: The conversation's input items before this response's output, oldest first.
    input_items: tuple[dict[str, Any], ...]
    #: The JSON length of `input_items` and of the output items.
    conversation_bytes: int
    #: What the store counts for it: the conversation and the response object.
    size: int

    @property
    def output_items(self) -> tuple[dict[str, Any], ...]:
        return tuple(self.response["output"])

    @property
    def conversation(self) -> tuple[dict[str, Any], ...]:
        """What a turn continuing this response starts from: its input, then its output."""
        return (*self.input_items, *self.output_items)

    @classmethod
    def of(
        cls,
        response: dict[str, Any],
        input_items: Sequence[dict[str, Any]],
        previous: StoredResponse | None = None,
    ) -> StoredResponse:
        """The stored form of a response that ended, whose conversation's input items were
        `input_items`: `previous`'s conversation then the request's own, unless truncation
        dropped some (`previous` only spares counting the bytes of the items it shares)."""
        items = tuple(input_items)
        shared = previous.conversation if previous is not None else ()
        counted = 0  # the leading items whose bytes `previous` counted
        if len(items) >= len(shared) and all(a is b for a, b in zip(items, shared, strict=False)):
            counted = len(shared)
        conversation_bytes = previous.conversation_bytes if counted and previous else 0
        conversation_bytes += sum(
            len(json_text(item)) for item in (*items[counted:], *response["output"])
        )
        return cls(
            id=response["id"],
            response=response,
            input_items=items,
            conversation_bytes=conversation_bytes,
            size=conversation_bytes + len(json_text(response)),
        )


@dataclass(frozen=True)
class StoreStatistics:
    """A snapshot of the server's store (`/v1/status`'s `response_store`)."""

    responses: int
    bytes: int
    evicted: int
    max_responses: int
    max_bytes: int


class ResponseStore:
    """The server's stored responses: at most `max_responses` of them and `max_bytes` in all,
    the oldest evicted first. A response larger than `max_bytes` alone is not kept."""

    def __init__(
        self,
        max_responses: int = DEFAULT_RESPONSES,
        max_bytes: int = int(DEFAULT_MEGABYTES * 1024 * 1024),
    ) -> None:
        self.max_responses = max(0, max_responses)
        self.max_bytes = max(0, max_bytes)
        self._responses: BoundedMap[str, StoredResponse] = BoundedMap(
            self.max_responses, self.max_bytes
        )

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def put(self, response: StoredResponse) -> None:
        """Keep `response` (the newest), evicting the oldest until both bounds hold."""
        if self.enabled:
            self._responses.put(response.id, response, response.size)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        return self._responses.pop(response_id) is not None

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            responses=len(self._responses),
            bytes=self._responses.bytes,
            evicted=self._responses.evicted,
            max_responses=self.max_responses,
            max_bytes=self.max_bytes,
        )


#: How many lanes' most recent responses a WebSocket connection keeps (`ConnectionCache`).
CACHED_LANES = 32


class ConnectionCache:
    """One WebSocket connection's responses: each lane's most recent one, for at most
    `max_lanes` lanes (see the module docstring). A lane is its `stream_id`, None the default
    lane's."""

    def __init__(self, max_lanes: int = CACHED_LANES) -> None:
        # Bounded by count alone: each entry is put as 0 bytes.
        self._latest: BoundedMap[str | None, StoredResponse] = BoundedMap(max_lanes, 0)

    def get(self, response_id: str) -> StoredResponse | None:
        """The response `response_id` if it is a lane's most recent one."""
        for lane in self._latest:
            found = self._latest.get(lane)
            if found is not None and found.id == response_id:
                return found
        return None

    def keep(self, lane: str | None, response: StoredResponse) -> None:
        """`response` is now `lane`'s most recent one (and that lane the newest)."""
        self._latest.put(lane, response, 0)

    def evict(self, response_id: str | None) -> None:
        """Drop the response `response_id` from whichever lane holds it."""
        for lane in list(self._latest):
            found = self._latest.get(lane)
            if found is not None and found.id == response_id:
                self._latest.pop(lane)

    def lane(self, stream_id: str | None) -> LaneCache:
        """The cache as a response of lane `stream_id` uses it."""
        return LaneCache(self, stream_id)


@dataclass(frozen=True)
class LaneCache:
    """A lane's view of its connection's cache: it reads (and evicts) any lane's responses,
    and keeps its own as its lane's most recent one."""

    connection: ConnectionCache
    stream_id: str | None

    def get(self, response_id: str) -> StoredResponse | None:
        return self.connection.get(response_id)

    def evict(self, response_id: str | None) -> None:
        self.connection.evict(response_id)

    def keep(self, response: StoredResponse) -> None:
        self.connection.keep(self.stream_id, response)


class ResponseKeeper:
    """Where one response goes when it ends: the server's store (None: `store` false) and its
    connection's cache (None: not on a WebSocket), with the conversation it had (`input_items`,
    asked for only when it is kept); and what else is told of it (`ended`: its conversation's
    append, `http/conversations/turn.py`)."""

    def __init__(
        self,
        input_items: Callable[[], Sequence[dict[str, Any]]],
        previous: StoredResponse | None,
        store: ResponseStore | None,
        connection: LaneCache | None,
        ended: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._input_items = input_items
        self._previous = previous
        self._store = store if store is not None and store.enabled else None
        self._connection = connection
        self._ended = ended

    @property
    def keeps(self) -> bool:
        """Whether a response that ends well is kept anywhere (or told to `ended`)."""
        return self._store is not None or self._connection is not None or self._ended is not None

    def keep(self, response: dict[str, Any]) -> None:
        """Keep a response that ended completed or incomplete (its object, dumped)."""
        if self._ended is not None:
            self._ended(response)
        if self._store is None and self._connection is None:
            return
        stored = StoredResponse.of(response, self._input_items(), self._previous)
        if self._store is not None:
            self._store.put(stored)
        if self._connection is not None:
            self._connection.keep(stored)

    def failed(self, previous_response_id: str | None) -> None:
        """The response failed: its connection forgets the response it continued."""
        if self._connection is not None:
            self._connection.evict(previous_response_id)


def previous_response(
    response_id: str, store: ResponseStore, connection: LaneCache | None = None
) -> StoredResponse:
    """The response a request continues: one its connection's lanes keep, else the server's
    stored one; else OpenAI's 400 `previous_response_not_found`."""
    found = connection.get(response_id) if connection is not None else None
    found = found or store.get(response_id)
    if found is None:
        raise APIError(
            400,
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return found


def response_not_found(response_id: str) -> APIError:
    """The 404 of the retrieval routes for an id that is not stored (never was, `store`
    false, evicted, deleted)."""
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        param="response_id",
        code="not_found",
    )
