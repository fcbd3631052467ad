"""Every refusal in the OpenAI error shape, with its status, `param` and headers."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from model_wrappers import GatedModel, wrapping_loader
from servers import eventually, running_server
from trio_mlx.http.server import RunningServer

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    assert isinstance(error["code"], str) and error["code"], error  # every error names a code
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages[0].content[0].image_url",
        ),
        ({"messages": MESSAGES, "temperature": 3}, "temperature"),
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": MESSAGES, "top_p": 0}, "top_p"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": MESSAGES, "stop": [""]}, "stop"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"1": 500}}, "logit_bias.1"),
        ({"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
async def test_chat_validation(http: httpx.AsyncClient, body: dict[str, Any], param: str) -> None:
    error = assert_error(await http.post(CHAT, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": [99999999]}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/responses", {"input": []}, "input"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ("/v1/responses", {"input": "hi", "previous_response_id": "r"}, "previous_response_id"),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].image_url",
        ),
    ],
)
async def test_other_routes_validation(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    assert_error(await http.post(path, json=body), 400, param)


async def test_prompt_too_long_is_400_before_any_stream(http: httpx.AsyncClient) -> None:
    prompt = [5] * 2000  # the tiny model's context is 1024 tokens
    for stream in (False, True):
        response = await http.post("/v1/completions", json={"prompt": prompt, "stream": stream})
        error = assert_error(response, 400, "prompt")
        assert error["code"] == "context_length_exceeded"


async def test_malformed_json_wrong_type_and_media(http: httpx.AsyncClient) -> None:
    response = await http.post(
        CHAT, content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert assert_error(response, 400)["code"] == "invalid_json"
    response = await http.post(
        CHAT, content=b"[1, 2]", headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400)
    response = await http.post(
        CHAT, content=json.dumps({"messages": MESSAGES}), headers={"Content-Type": "text/plain"}
    )
    assert_error(response, 415)


async def test_unknown_routes_methods_and_models(
    http: httpx.AsyncClient, client: openai.AsyncOpenAI
) -> None:
    assert assert_error(await http.get("/v1/nothing"), 404)["type"] == "not_found_error"
    response = await http.get(CHAT)
    assert_error(response, 405)
    assert "POST" in response.headers["allow"]
    assert_error(await http.delete("/v1/models"), 405)
    error = assert_error(
        await http.post(CHAT, json={"model": "gpt-4", "messages": MESSAGES}), 404, "model"
    )
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4", messages=MESSAGES)  # type: ignore[arg-type]


async def test_body_size_limit(tiny_model_dir: Path) -> None:
    async with (
        running_server(tiny_model_dir, max_body_bytes=2048) as server,
        httpx.AsyncClient(base_url=server.url) as http,
    ):
        big = {"messages": [{"role": "user", "content": "x" * 4096}]}
        assert assert_error(await http.post(CHAT, json=big), 413)["code"] == "request_too_large"
        small = {"messages": MESSAGES, "max_tokens": 2}
        assert (await http.post(CHAT, json=small)).status_code == 200


async def test_busy_engine_is_429_with_retry_after(tiny_model_dir: Path) -> None:
    loader, made = wrapping_loader(GatedModel)
    async with (
        running_server(tiny_model_dir, loader=loader, max_num_seqs=1) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        gate = made[0].gate
        gate.clear()  # the runner blocks in its next forward pass
        held = trio.Event()

        async def hold() -> None:
            body = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
            async with http.stream("POST", CHAT, json=body) as response:
                assert response.status_code == 200
                held.set()
                await response.aread()

        nursery.start_soon(hold)
        engine = server.state.engine
        assert engine is not None
        await eventually(lambda: engine.get_stats()["running"] == 1)
        for stream in (False, True):
            response = await http.post(CHAT, json={"messages": MESSAGES, "stream": stream})
            error = assert_error(response, 429)
            assert error["type"] == "overloaded_error"
            assert int(response.headers["retry-after"]) >= 1
        gate.set()
        with trio.fail_after(30):
            await held.wait()


async def test_health_models_status_openapi(server: RunningServer, http: httpx.AsyncClient) -> None:
    health = await http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert (await http.get("/v1/models/tiny-alias")).json()["id"] == "tiny-alias"
    assert_error(await http.get("/v1/models/other"), 404, "model")
    status = (await http.get("/v1/status")).json()
    assert status["running"] == 0 and status["server"]["phase"] == "ready"
    doc = (await http.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.2")
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/input_tokens",
        "/v1/models",
        "/health",
        "/v1/status",
        "/v1/cache/stats",
        "/v1/cache",
        "/metrics",
    ):
        assert path in doc["paths"], path
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "404", "413", "415", "429", "503"} <= set(chat["responses"])
    assert "ChatCompletionRequest" in doc["components"]["schemas"]


async def test_health_is_503_while_loading(tiny_model_dir: Path) -> None:
    loaded = threading.Event()
    from trio_mlx.engine.loading import load_model

    def slow_loader(spec: Any) -> Any:  # runs on the runner thread
        result = load_model(spec)
        loaded.wait(timeout=30)
        return result

    async with (
        running_server(tiny_model_dir, loader=slow_loader, wait_ready=False) as server,
        httpx.AsyncClient(base_url=server.url) as http,
    ):
        response = await http.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        assert_error(await http.post(CHAT, json={"messages": MESSAGES}), 503)
        loaded.set()
        with trio.fail_after(30):
            await server.state.ready.wait()
        assert (await http.get("/health")).status_code == 200


async def test_load_failure_stops_the_server(tmp_path: Path) -> None:
    from trio_mlx.errors import ModelLoadError
    from trio_mlx.http.server import serve_http
    from trio_mlx.http.state import ServerSettings

    with trio.fail_after(30), pytest.raises(ModelLoadError, match="missing"):
        await serve_http(ServerSettings(model=tmp_path / "missing", port=0))
