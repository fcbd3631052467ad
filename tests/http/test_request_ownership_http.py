"""An admitted request's slot is owned by its HTTP request's ASGI call: a client that goes away at
any point of a response's life — while its body is still arriving, on the response's start
(before the first byte), after the first chunk, or after the last — leaves the engine idle.

The app is called directly over ASGI, so each disconnect lands exactly where the test puts it:
the test's `send` sees the message, the `receive` then reports `http.disconnect`, and quart-trio
cancels the handler (the harness never sleeps for time)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import trio

from idle import wait_until_idle
from trio_mlx.actors.engine import Engine
from trio_mlx.http.app import create_app
from trio_mlx.http.state import ServerSettings, ServerState

MESSAGES = [{"role": "user", "content": "Count forever."}]
STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 400, "stream": True}),
    "completions": ("/v1/completions", {"prompt": "Once upon", "max_tokens": 400, "stream": True}),
    "responses": ("/v1/responses", {"input": "Count.", "max_output_tokens": 400, "stream": True}),
    "messages": ("/v1/messages", {"messages": MESSAGES, "max_tokens": 400, "stream": True}),
}

Message = dict[str, Any]


def _app(engine: Engine) -> Any:
    state = ServerState(ServerSettings())
    state.engine = engine
    state.ready.set()
    return create_app(state)


def _is_start(message: Message) -> bool:
    return message["type"] == "http.response.start"


def _is_first_chunk(message: Message) -> bool:
    return message["type"] == "http.response.body" and bool(message.get("body"))


async def call(
    app: Any,
    path: str,
    payload: dict[str, Any],
    *,
    disconnect_at: Callable[[Message], bool] | None = None,
    body_split: bool = False,
    gone: trio.Event | None = None,
) -> list[Message]:
    """One POST through the ASGI app. With `disconnect_at`, the client goes away when the app
    sends the first message it matches (that `send` never returns: the handler is cancelled
    there). `body_split`: only half the body arrives before the disconnect. `gone`: the client
    goes away when the test sets it."""
    data = json.dumps(payload).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "extensions": {},
    }
    gone = trio.Event() if gone is None else gone
    if body_split:
        gone.set()
    parts = [data[: len(data) // 2]] if body_split else [data]
    sent: list[Message] = []

    async def receive() -> Message:
        if parts:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": body_split}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if disconnect_at is not None and disconnect_at(message):
            gone.set()
            await trio.sleep_forever()  # the client is gone: this write never completes
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            gone.set()

    with trio.fail_after(30):
        await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("route", sorted(STREAMS))
async def test_a_disconnect_on_the_response_start_frees_the_slot(
    engine: Engine, route: str
) -> None:
    """Before the first byte: the body generator never started, the slot is freed anyway."""
    path, payload = STREAMS[route]
    sent = await call(_app(engine), path, payload, disconnect_at=_is_start)
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert sent[0]["status"] == 200
    stats = await wait_until_idle(engine)
    assert stats["admitted"] == 1


@pytest.mark.parametrize("route", sorted(STREAMS))
async def test_a_disconnect_after_the_first_chunk_frees_the_slot(
    engine: Engine, route: str
) -> None:
    path, payload = STREAMS[route]
    sent = await call(_app(engine), path, payload, disconnect_at=_is_first_chunk)
    assert _is_first_chunk(sent[-1])
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] + stats["finished"].get("abort", 0) >= 1


@pytest.mark.parametrize("route", sorted(STREAMS))
async def test_a_disconnect_while_the_body_arrives_admits_nothing(
    engine: Engine, route: str
) -> None:
    path, payload = STREAMS[route]
    await call(_app(engine), path, payload, body_split=True)
    stats = await wait_until_idle(engine)
    assert stats["admitted"] == 0


@pytest.mark.parametrize("route", sorted(STREAMS))
async def test_a_response_sent_to_its_end_leaves_the_engine_idle(
    engine: Engine, route: str
) -> None:
    path, payload = STREAMS[route]
    short = {**payload}
    short["max_output_tokens" if route == "responses" else "max_tokens"] = 4
    sent = await call(_app(engine), path, short)
    assert sent[0]["status"] == 200
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    await wait_until_idle(engine)


@pytest.mark.parametrize("route", sorted(STREAMS))
async def test_a_disconnect_mid_generation_of_a_whole_answer_frees_the_slot(
    engine: Engine, route: str
) -> None:
    """Non-streaming: the client goes away once the request holds its slot."""
    path, payload = STREAMS[route]
    app = _app(engine)
    whole = {**payload, "stream": False}
    gone = trio.Event()
    sent: list[Message] = []

    async def watch_admission() -> None:
        while engine.get_stats()["running"] == 0:  # noqa: ASYNC110 (admission is not an event)
            await trio.sleep(0.001)
        gone.set()

    async def client() -> None:
        sent.extend(await call(app, path, whole, gone=gone))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_admission)
        nursery.start_soon(client)
    assert not any(_is_first_chunk(m) for m in sent)  # it went away before any answer
    stats = await wait_until_idle(engine)
    assert stats["admitted"] == 1
