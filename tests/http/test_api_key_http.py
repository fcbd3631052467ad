"""`--api-key`: every route but /health and the chat page needs the key (Bearer or x-api-key);
a request without it gets 401 in the OpenAI error shape (Anthropic's under /v1/messages), the
WebSocket is refused before its handshake completes, and the refusal is in the access log."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
import websockets.exceptions
import websockets.sync.client

from servers import eventually, running_server, serve_process
from trio_mlx.cli import build_parser
from trio_mlx.http.server import RunningServer, settings_from_args

KEY = "sk-test-0123456789"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

#: One request of every route family: (method, path, JSON body or None).
GUARDED = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
    ("GET", "/v1/status", None),
    ("GET", "/v1/cache/stats", None),
    ("DELETE", "/v1/cache", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/no/such/route", None),
]


@pytest.fixture
async def keyed_server(tiny_model_dir: Path) -> AsyncIterator[RunningServer]:
    async with running_server(tiny_model_dir, served_model_names=("tiny",), api_key=KEY) as srv:
        yield srv


@pytest.fixture
async def anonymous(keyed_server: RunningServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=keyed_server.url, timeout=30) as http:
        yield http


async def send(
    http: httpx.AsyncClient, method: str, path: str, body: Any, headers: dict[str, str]
) -> httpx.Response:
    return await http.request(method, path, json=body, headers=headers)


async def test_every_route_without_the_key_gets_401_invalid_api_key(
    anonymous: httpx.AsyncClient,
) -> None:
    for method, path, body in GUARDED:
        response = await send(anonymous, method, path, body, {})
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
        payload = response.json()
        if path == "/v1/messages":
            assert payload["type"] == "error", path
            assert payload["error"]["type"] == "authentication_error"
        else:
            assert payload["error"]["code"] == "invalid_api_key", path
            assert payload["error"]["type"] == "invalid_request_error"
            assert set(payload["error"]) == {"message", "type", "param", "code"}
            assert "x-api-key" in payload["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer wrong-key"},
        {"x-api-key": "wrong-key"},
        {"Authorization": "Basic " + KEY},  # the key, but not as a bearer token
        {"Authorization": f"Bearer {KEY}x"},  # the key and one more character
        {"Authorization": f"Bearer {KEY[:-1]}"},  # a prefix of the key
        {"Authorization": "Bearer"},
    ],
    ids=["wrong-bearer", "wrong-x-api-key", "basic", "longer", "prefix", "empty"],
)
async def test_every_route_with_a_wrong_key_gets_401(
    anonymous: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    for method, path, body in GUARDED:
        response = await send(anonymous, method, path, body, headers)
        assert response.status_code == 401, path
        if path != "/v1/messages":
            assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"x-api-key": KEY}],
    ids=["bearer", "lowercase-bearer", "x-api-key"],
)
async def test_every_route_with_the_key_in_either_header_passes(
    anonymous: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    for method, path, body in GUARDED:
        response = await send(anonymous, method, path, body, headers)
        assert response.status_code != 401, (path, response.text)
        if path == "/no/such/route":
            assert response.status_code == 404
        elif path != "/v1/messages":  # another branch adds the Anthropic routes
            assert response.status_code == 200, (path, response.text)


@pytest.mark.parametrize(
    ("path", "accept", "content_type"),
    [
        ("/health", "*/*", "application/json"),
        ("/", "*/*", "application/json"),
        ("/", "text/html", "text/html; charset=utf-8"),
        ("/page/chat.js", "*/*", "text/javascript; charset=utf-8"),
        ("/page/chat.css", "*/*", "text/css; charset=utf-8"),
    ],
)
async def test_health_and_the_page_stay_open(
    anonymous: httpx.AsyncClient, path: str, accept: str, content_type: str
) -> None:
    response = await anonymous.get(path, headers={"Accept": accept})
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type


async def test_the_openai_client_with_the_key_works_and_without_it_raises_authentication_error(
    keyed_server: RunningServer,
) -> None:
    async with openai.AsyncOpenAI(
        base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0
    ) as good:
        reply = await good.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
    async with openai.AsyncOpenAI(
        base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0
    ) as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            await bad.models.list()
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


async def test_the_stored_response_routes_need_the_key(keyed_server: RunningServer) -> None:
    async with openai.AsyncOpenAI(
        base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0
    ) as good:
        created = await good.responses.create(model="tiny", input="Hi", max_output_tokens=2)
        paths = [f"/v1/responses/{created.id}", f"/v1/responses/{created.id}/input_items"]
        async with httpx.AsyncClient(base_url=keyed_server.url, timeout=30) as anonymous:
            for method, path in [("GET", paths[0]), ("GET", paths[1]), ("DELETE", paths[0])]:
                response = await anonymous.request(method, path)
                assert response.status_code == 401, (method, path)
                assert response.json()["error"]["code"] == "invalid_api_key"
        assert (await good.responses.retrieve(created.id)).id == created.id
        assert [item.type async for item in good.responses.input_items.list(created.id)] == [
            "message"
        ]
        await good.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            await good.responses.retrieve(created.id)


def _socket_url(server: RunningServer) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


async def test_the_websocket_without_the_key_is_refused_with_401(
    keyed_server: RunningServer,
) -> None:
    def connect(headers: dict[str, str]) -> Any:
        with pytest.raises(websockets.exceptions.InvalidStatus) as caught:
            websockets.sync.client.connect(
                _socket_url(keyed_server), additional_headers=headers, open_timeout=10
            )
        return caught.value.response

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = await trio.to_thread.run_sync(connect, headers)
        assert response.status_code == 401
        assert b"invalid_api_key" in response.body


async def test_the_websocket_with_the_key_answers_through_the_openai_client(
    keyed_server: RunningServer,
) -> None:
    def session(api_key: str) -> list[str]:
        sync = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=api_key, max_retries=0)
        kinds: list[str] = []
        with sync.responses.connect() as connection:
            connection.send({"type": "response.create", "input": "Hi", "max_output_tokens": 3})
            for event in connection:
                kinds.append(event.type)
                if event.type in ("response.completed", "response.incomplete", "error"):
                    break
        return kinds

    kinds = await trio.to_thread.run_sync(session, KEY)
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    with pytest.raises(websockets.exceptions.InvalidStatus):
        await trio.to_thread.run_sync(session, "wrong")


async def test_a_refused_request_is_in_the_access_log_with_401(
    anonymous: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="trio_mlx.access"):
        response = await anonymous.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 401
        # The line is written when the ASGI call ends, just after the response's last byte.
        await eventually(
            lambda: any("/v1/chat/completions" in r.getMessage() for r in caplog.records)
        )
    line = next(r.getMessage() for r in caplog.records if "/v1/chat/completions" in r.getMessage())
    assert '"POST /v1/chat/completions HTTP/1.1" 401' in line
    assert KEY not in caplog.text


async def test_a_refused_body_is_read_so_the_connection_serves_the_retry(
    anonymous: httpx.AsyncClient,
) -> None:
    refused = await anonymous.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 401
    assert "close" not in refused.headers.get("connection", "")
    retried = await anonymous.post(
        "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert retried.status_code == 200


async def test_a_refused_body_over_the_limit_closes_the_connection(
    tiny_model_dir: Path,
) -> None:
    async with (
        running_server(tiny_model_dir, api_key=KEY, max_body_bytes=1024) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        refused = await http.post("/v1/chat/completions", content=b"x" * 4096)
        assert refused.status_code == 401
        assert refused.headers["connection"] == "close"
        assert (await http.get("/health")).status_code == 200


def test_serve_takes_the_key_from_the_flag_and_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRIO_MLX_API_KEY", raising=False)
    assert settings_from_args(build_parser().parse_args(["serve"])).api_key is None
    flagged = build_parser().parse_args(["serve", "--api-key", "from-flag"])
    assert settings_from_args(flagged).api_key == "from-flag"
    monkeypatch.setenv("TRIO_MLX_API_KEY", "from-env")
    assert settings_from_args(build_parser().parse_args(["serve"])).api_key == "from-env"
    flagged = build_parser().parse_args(["serve", "--api-key", "from-flag"])
    assert settings_from_args(flagged).api_key == "from-flag"


def test_trio_mlx_serve_with_the_key_in_its_environment_needs_it(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_MLX_API_KEY", KEY)
    assert os.environ["TRIO_MLX_API_KEY"] == KEY
    with serve_process(tiny_model_dir) as (_process, url), httpx.Client(base_url=url) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert http.get("/health").status_code == 200
