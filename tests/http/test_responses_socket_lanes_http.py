"""The Responses WebSocket's lanes (`stream_id`), through the openai client's connection:
concurrent lanes, each FIFO, every event echoing its lane; the default lane as before; forks
across lanes through the connection's cache; errors confined to their lane; the bounds; and a
closed socket aborting every lane."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import trio

from idle import wait_until_idle
from trio_mlx.http.responses import socket_lanes
from trio_mlx.http.responses.store import ConnectionCache, StoredResponse
from trio_mlx.http.server import RunningServer

FIRST, SECOND = "Name a colour.", "And another one?"
GREEDY: dict[str, Any] = {"model": "tiny", "max_output_tokens": 12, "temperature": 0}
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")
Event = dict[str, Any]


def create(**fields: Any) -> Any:
    return {"type": "response.create", **fields}


def session(
    server: RunningServer,
    messages: list[Any],
    ends: int,
    then: Callable[[Any, list[Event]], None] | None = None,
) -> list[Event]:
    """Send `messages` back to back on one connection of the openai client (a callable sends
    its own with the connection); every event (as its raw JSON) until `ends` responses have
    ended; `then(connection, events)` before it closes."""
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    events: list[Event] = []
    with sync.responses.connect() as connection:
        for message in messages:
            if callable(message):
                message(connection)
            else:
                connection.send(message)
        ended = 0
        while ended < ends:
            events.append(json.loads(connection.recv_bytes()))
            ended += events[-1]["type"] in ENDS
        if then is not None:
            then(connection, events)
    return events


def lane(events: list[Event], stream_id: str) -> list[Event]:
    return [event for event in events if event.get("stream_id") == stream_id]


def text(events: list[Event]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def index(events: list[Event], kind: str, response_id: str | None = None) -> int:
    """Where the first event of `kind` (of response `response_id`) is."""
    for i, event in enumerate(events):
        if event["type"] == kind and (
            response_id is None or event["response"]["id"] == response_id
        ):
            return i
    raise AssertionError(f"no {kind} event")


async def alone(client: openai.AsyncOpenAI, **fields: Any) -> str:
    response = await client.responses.create(**{**GREEDY, **fields})
    return response.output_text


async def test_two_lanes_run_concurrently_and_echo_their_stream_id(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    long = {**GREEDY, "max_output_tokens": 48}
    events = await trio.to_thread.run_sync(
        lambda: session(
            server,
            [
                create(**long, input=FIRST, stream_id="a"),
                # The SDK's own `response.create` takes `stream_id` too.
                lambda connection: connection.response.create(**long, input=SECOND, stream_id="b"),
            ],
            ends=2,
        )
    )
    assert {event.get("stream_id") for event in events} == {"a", "b"}  # every event tagged
    a, b = lane(events, "a"), lane(events, "b")
    for one in (a, b):
        assert one[0]["type"] == "response.created"
        assert one[-1]["type"] == "response.incomplete"
        assert [e["sequence_number"] for e in one] == list(range(len(one)))
    assert text(a) == a[-1]["response"]["output_text"] == await alone(client, **long, input=FIRST)
    assert text(b) == b[-1]["response"]["output_text"] == await alone(client, **long, input=SECOND)
    # Concurrent: the second lane's response started before the first lane's ended.
    assert index(events, "response.created", b[0]["response"]["id"]) < index(
        events, "response.incomplete", a[0]["response"]["id"]
    )


async def test_a_lane_is_fifo(server: RunningServer, client: openai.AsyncOpenAI) -> None:
    events = await trio.to_thread.run_sync(
        lambda: session(
            server,
            [
                create(**GREEDY, input=FIRST, stream_id="a"),
                create(**GREEDY, input=SECOND, stream_id="a"),
            ],
            ends=2,
        )
    )
    assert all(event["stream_id"] == "a" for event in events)
    created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
    first, second = created
    # The second waits for the first: its response.created comes after the first's end.
    assert index(events, "response.incomplete", first) < index(events, "response.created", second)
    ends = [e for e in events if e["type"] == "response.incomplete"]
    assert [e["response"]["output_text"] for e in ends] == [
        await alone(client, input=FIRST),
        await alone(client, input=SECOND),
    ]


async def test_messages_without_stream_id_are_unchanged(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    events = await trio.to_thread.run_sync(
        lambda: session(
            server,
            [
                create(**GREEDY, input=FIRST),
                create(**GREEDY, input=SECOND, stream_id="a"),
                create(**GREEDY, input=SECOND),
                create(model="no-such-model", input=FIRST),
            ],
            ends=4,
        )
    )
    default = [event for event in events if "stream_id" not in event]
    assert len(lane(events, "a")) + len(default) == len(events)
    # The default lane: its responses one after the other, then its error, no stream_id.
    kinds = [e["type"] for e in default]
    created = [i for i, kind in enumerate(kinds) if kind == "response.created"]
    ended = [i for i, kind in enumerate(kinds) if kind == "response.incomplete"]
    assert created[0] == 0 and ended[0] < created[1] and ended[1] == len(kinds) - 2
    assert kinds[-1] == "error" and default[-1]["error"]["param"] == "model"
    ends = [e["response"]["output_text"] for e in default if e["type"] == "response.incomplete"]
    assert ends == [
        await alone(client, input=FIRST),
        await alone(client, input=SECOND),
    ]
    assert text(lane(events, "a")) == await alone(client, input=SECOND)


async def test_a_lane_forks_from_another_lanes_response_with_store_false(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    def fork(connection: Any, events: list[Event]) -> None:
        first = events[-1]["response"]["id"]
        for stream_id in ("b", "a"):  # a fork on b, then a continues its own response too
            connection.send(
                create(
                    **GREEDY,
                    input=SECOND,
                    store=False,
                    previous_response_id=first,
                    stream_id=stream_id,
                )
            )
            while True:
                events.append(json.loads(connection.recv_bytes()))
                if events[-1]["type"] in ENDS:
                    break

    events = await trio.to_thread.run_sync(
        lambda: session(
            server, [create(**GREEDY, input=FIRST, store=False, stream_id="a")], 1, fork
        )
    )
    ends = [e for e in events if e["type"] in ENDS]
    first, forked, continued = ends
    assert [e["stream_id"] for e in ends] == ["a", "b", "a"]
    assert forked["type"] == continued["type"] == "response.incomplete", ends
    assert forked["response"]["previous_response_id"] == first["response"]["id"]
    whole = await alone(
        client,
        input=[
            {"role": "user", "content": FIRST},
            *first["response"]["output"],
            {"role": "user", "content": SECOND},
        ],
        store=False,
    )
    assert forked["response"]["output_text"] == continued["response"]["output_text"] == whole
    # Neither is stored: only the connection's cache held the first.
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first["response"]["id"])


async def test_an_error_on_one_lane_leaves_the_other_alone(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    long = {**GREEDY, "max_output_tokens": 32}
    events = await trio.to_thread.run_sync(
        lambda: session(
            server,
            [
                create(**long, input=FIRST, stream_id="a"),
                create(model="no-such-model", input=FIRST, stream_id="b"),
                create(**GREEDY, input=FIRST, background=True, stream_id="c"),
                {"type": "response.nope", "stream_id": "d"},
                create(**GREEDY, input=FIRST, stream_id=""),  # no lane: the default's error
            ],
            ends=5,
        )
    )
    errors = {e.get("stream_id"): e for e in events if e["type"] == "error"}
    assert set(errors) == {"b", "c", "d", None}
    assert errors["b"]["status"] == 404 and errors["b"]["error"]["param"] == "model"
    assert errors["c"]["status"] == 400 and errors["c"]["error"]["param"] == "background"
    assert errors["d"]["status"] == 400 and errors["d"]["error"]["param"] == "type"
    assert errors[None]["status"] == 400 and errors[None]["error"]["param"] == "stream_id"
    a = lane(events, "a")
    assert a[-1]["type"] == "response.incomplete"
    assert text(a) == await alone(client, **long, input=FIRST)


async def test_closing_the_socket_aborts_every_lane(server: RunningServer) -> None:
    engine = server.state.engine
    assert engine is not None
    before = engine.get_stats()["runner"]
    long = {"input": "Count forever.", "max_output_tokens": 900, "temperature": 0}

    def deltas(events: list[Event], stream_id: str) -> int:
        return sum(e["type"] == "response.output_text.delta" for e in lane(events, stream_id))

    def until_both_write(connection: Any, events: list[Event]) -> None:
        while min(deltas(events, "a"), deltas(events, "b")) < 3:
            events.append(json.loads(connection.recv_bytes()))

    def leave_midway() -> list[Event]:
        return session(
            server,
            [create(**long, stream_id="a"), create(**long, stream_id="b")],
            ends=0,
            then=until_both_write,
        )

    events = await trio.to_thread.run_sync(leave_midway)
    assert not [e for e in events if e["type"] in ENDS]  # both were mid-generation
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before["aborted"] + 2
    assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 2 * 900
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        with trio.fail_after(10):
            reply = await http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
            )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3


async def test_the_bounds_refuse_with_an_error_naming_the_lane(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket_lanes, "MAX_LANES", 2)
    monkeypatch.setattr(socket_lanes, "MAX_QUEUED", 1)
    long = {"input": "Count forever.", "max_output_tokens": 900, "temperature": 0}
    events = await trio.to_thread.run_sync(
        lambda: session(
            server,
            [
                create(**long, stream_id="a"),
                create(**long, stream_id="b"),
                create(**long, stream_id="c"),  # a third lane: refused
                create(**long, stream_id="a"),  # waits behind a's first
                create(**long, stream_id="a"),  # a second one waiting: refused
            ],
            ends=2,
        )
    )
    errors = [e for e in events if e["type"] == "error"]
    assert [(e["stream_id"], e["error"]["code"]) for e in errors] == [
        ("c", "too_many_lanes"),
        ("a", "lane_queue_full"),
    ]
    assert all(e["status"] == 429 and e["error"]["param"] == "stream_id" for e in errors)
    assert not [e for e in events if e["type"] in ENDS and e["type"] != "error"]
    engine = server.state.engine
    assert engine is not None
    await wait_until_idle(engine)  # the socket closed: a's and b's responses were aborted


async def test_the_default_lane_waits_for_room_instead_of_refusing(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket_lanes, "MAX_QUEUED", 1)
    events = await trio.to_thread.run_sync(
        lambda: session(server, [create(**GREEDY, input=FIRST)] * 5, ends=5)
    )
    assert [e["type"] for e in events if e["type"] in ENDS] == ["response.incomplete"] * 5
    assert not [e for e in events if "stream_id" in e]
    created = [i for i, e in enumerate(events) if e["type"] == "response.created"]
    ended = [i for i, e in enumerate(events) if e["type"] in ENDS]
    assert all(end < start for end, start in zip(ended, created[1:], strict=False))  # FIFO


def test_the_connection_cache_keeps_each_lanes_latest_response_bounded() -> None:
    def response(response_id: str) -> StoredResponse:
        return StoredResponse.of({"id": response_id, "output": []}, [])

    cache = ConnectionCache(max_lanes=2)
    lanes = {lane: cache.lane(lane) for lane in (None, "a", "b")}
    lanes[None].keep(response("r1"))
    lanes["a"].keep(response("r2"))
    assert lanes["b"].get("r1") is not None and lanes["b"].get("r2") is not None  # any lane's
    lanes["a"].keep(response("r3"))  # a's latest replaces its earlier one
    assert cache.get("r2") is None and cache.get("r1") is not None
    lanes["b"].keep(response("r4"))  # a third lane: the one kept least recently goes (None's)
    assert cache.get("r1") is None and cache.get("r3") is not None and cache.get("r4") is not None
    lanes[None].evict("r3")  # a failed turn drops the response it named, whichever lane's
    assert cache.get("r3") is None and cache.get("r4") is not None
