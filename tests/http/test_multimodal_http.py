"""Images over HTTP: the openai client against a server on the tiny random Qwen2-VL.

Loopback only: a loopback media server (tests/media_samples.py) serves images by URL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from media_samples import data_url, image_message, media_server, png
from servers import running_server, serve_process
from trio_mlx.http.server import RunningServer
from trio_mlx.multimodal.media import MediaPolicy

GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0}


@pytest.fixture
async def vlm_server(tiny_vlm_dir: Path) -> AsyncIterator[RunningServer]:
    async with running_server(tiny_vlm_dir, served_model_names=("vlm",)) as server:
        yield server


@pytest.fixture
async def vlm_client(vlm_server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=vlm_server.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


async def _chat(client: openai.AsyncOpenAI, url: str) -> str:
    reply = await client.chat.completions.create(
        model="vlm",
        messages=image_message(url),
        **GREEDY,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


async def test_an_image_changes_the_reply_and_the_same_image_repeats_it(
    vlm_client: openai.AsyncOpenAI,
) -> None:
    first = await _chat(vlm_client, data_url(png(0)))
    other = await _chat(vlm_client, data_url(png(1)))
    again = await _chat(vlm_client, data_url(png(0)))
    assert first != other
    assert first == again


async def test_streamed_image_chat_with_usage(vlm_client: openai.AsyncOpenAI) -> None:
    stream = await vlm_client.chat.completions.create(
        model="vlm",
        messages=image_message(data_url(png(0))),  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    whole = await vlm_client.chat.completions.create(
        model="vlm",
        messages=image_message(data_url(png(0))),
        **GREEDY,  # type: ignore[arg-type]
    )
    assert text == whole.choices[0].message.content
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 4  # the 4 image tokens counted


async def test_responses_take_input_image(vlm_client: openai.AsyncOpenAI) -> None:
    response = await vlm_client.responses.create(
        model="vlm",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(png(0)), "detail": "auto"},
                    {"type": "input_text", "text": "What is in this image?"},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert response.output_text == await _chat(vlm_client, data_url(png(0)))


@pytest.mark.parametrize(
    "url",
    [
        data_url(b"definitely not a picture"),
        "data:image/png;base64,@@@",
        "http://127.0.0.1:9/private.png",
        "/etc/hostname",
    ],
)
async def test_bad_images_are_400_naming_the_part(vlm_server: RunningServer, url: str) -> None:
    async with httpx.AsyncClient(base_url=vlm_server.url, timeout=60) as http:
        body = {"messages": [{"role": "user", "content": "hi"}, *image_message(url)]}
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "messages[1].content[0].image_url"
        responses = await http.post(
            "/v1/responses",
            json={
                "instructions": "Answer briefly.",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
            },
        )
        assert responses.status_code == 400, responses.text
        assert responses.json()["error"]["param"] == "input[0].content[0].image_url"


async def test_a_loopback_image_url_is_refused_unless_allowed(tiny_vlm_dir: Path) -> None:
    async with media_server({"a.png": png(0)}) as (base, _arrived):
        async with running_server(tiny_vlm_dir) as guarded:
            async with httpx.AsyncClient(base_url=guarded.url, timeout=60) as http:
                body = {"messages": image_message(f"{base}/a.png"), **GREEDY}
                reply = await http.post("/v1/chat/completions", json=body)
                assert reply.status_code == 400
                assert reply.json()["error"]["code"] == "media_not_allowed"
        policy = MediaPolicy(allow_private_urls=True)
        async with running_server(
            tiny_vlm_dir, served_model_names=("vlm",), media=policy
        ) as open_server:
            async with openai.AsyncOpenAI(
                base_url=open_server.url + "/v1", api_key="unused", max_retries=0, timeout=60
            ) as client:
                assert await _chat(client, f"{base}/a.png") == await _chat(client, data_url(png(0)))


async def test_a_client_gone_during_the_image_fetch_leaves_the_server_free(
    tiny_vlm_dir: Path,
) -> None:
    stall = trio.Event()
    policy = MediaPolicy(allow_private_urls=True, fetch_timeout=60)
    async with media_server({}, stall=stall) as (base, _arrived):
        async with running_server(tiny_vlm_dir, media=policy) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                async with trio.open_nursery() as nursery:

                    async def post() -> None:
                        body = {"messages": image_message(f"{base}/a.png"), **GREEDY}
                        await http.post("/v1/chat/completions", json=body)

                    nursery.start_soon(post)
                    await stall.wait()
                    nursery.cancel_scope.cancel()
                reply = await http.post(
                    "/v1/chat/completions",
                    json={"messages": image_message(data_url(png(0))), **GREEDY},
                )
                assert reply.status_code == 200
                status = (await http.get("/v1/status")).json()
                assert status["running"] == 0


def test_trio_mlx_serve_reads_local_images_only_under_the_allowed_path(
    tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "a.png").write_bytes(png(0))
    with serve_process(
        tiny_vlm_dir, "--allowed-local-media-path", str(tmp_path), "--max-media-mb", "1"
    ) as (_process, url):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            local = client.chat.completions.create(
                model="tiny-qwen2-vl",
                messages=image_message(str(tmp_path / "a.png")),  # type: ignore[arg-type]
                **GREEDY,
            )
            inline = client.chat.completions.create(
                model="tiny-qwen2-vl",
                messages=image_message(data_url(png(0))),  # type: ignore[arg-type]
                **GREEDY,
            )
            assert local.choices[0].message.content == inline.choices[0].message.content
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model="tiny-qwen2-vl",
                    messages=image_message("/etc/hostname"),  # type: ignore[arg-type]
                    **GREEDY,
                )
            assert info.value.body["param"] == "messages[0].content[0].image_url"  # type: ignore[index]


async def test_an_image_and_a_text_request_together_on_a_batching_server(
    tiny_vlm_dir: Path,
) -> None:
    """With max_num_seqs > 1 the text request decodes in the batch and the image request takes
    its vision step beside it, then prefills and decodes in it (multimodal/joining.py):
    together, each gets what it gets alone; /metrics counts the join."""
    text = [{"role": "user", "content": "Tell me about the sea."}]
    async with running_server(tiny_vlm_dir, served_model_names=("vlm",), max_num_seqs=4) as server:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
        ) as client:

            async def ask(messages: Any) -> str:
                reply = await client.chat.completions.create(
                    model="vlm",
                    messages=messages,
                    **GREEDY,  # type: ignore[arg-type]
                )
                return reply.choices[0].message.content or ""

            alone = [await ask(image_message(data_url(png(0)))), await ask(text)]
            together: list[str] = ["", ""]

            async def one(i: int, messages: Any) -> None:
                together[i] = await ask(messages)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, image_message(data_url(png(0))))
                nursery.start_soon(one, 1, text)
            assert together == alone
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                runner = (await http.get("/v1/status")).json()["runner"]
                metrics = (await http.get("/metrics")).text
            assert runner["batching"] is True and runner["media_steps"] > 0
            assert runner["media_joined"] == 2  # alone, then beside the text request
            assert 'trio_mlx:media_joined_total{model_name="vlm"} 2' in metrics
            assert 'trio_mlx:num_sequences_media{model_name="vlm"} 0' in metrics


async def test_an_image_with_a_json_schema_gets_a_reply_in_it(
    vlm_client: openai.AsyncOpenAI,
) -> None:
    """`response_format` holds for a request with an image as for text (the openai client)."""
    import json

    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = await vlm_client.chat.completions.create(
        model="vlm",
        messages=image_message(data_url(png(2))),  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": schema, "strict": True},
        },
        max_tokens=40,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content or "") in (
        {"answer": "yes"},
        {"answer": "no"},
    )


async def test_an_image_with_a_required_tool_gets_a_call(vlm_client: openai.AsyncOpenAI) -> None:
    """`tool_choice` "required" and a named function hold for a request with an image (their
    forced tool-call grammar is the request's output format)."""
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "describe",
                "parameters": {
                    "type": "object",
                    "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
                    "required": ["colour"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    choices: Any = ("required", {"type": "function", "function": {"name": "describe"}})
    for choice in choices:
        reply = await vlm_client.chat.completions.create(
            model="vlm",
            messages=image_message(data_url(png(1))),  # type: ignore[arg-type]
            tools=tools,
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = reply.choices[0].message.tool_calls or []
        assert [c.function.name for c in calls] == ["describe"]  # type: ignore[union-attr]
        arguments = calls[0].function.arguments  # type: ignore[union-attr]
        assert arguments in ('{"colour": "red"}', '{"colour": "blue"}')


async def test_images_and_texts_under_load_with_clients_leaving(tiny_vlm_dir: Path) -> None:
    """24 streams at a batching vision server (6 slots, the rest queued): every other one with
    an image, greedy or sampled, some clients gone after a few chunks. All 200, nothing fails,
    the image requests join the batch, and the engine ends idle with nothing held."""
    import random

    from servers import eventually

    statuses: list[int] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(i)
        messages: Any = (
            image_message(data_url(png(i % 5)))
            if i % 2 == 0
            else [{"role": "user", "content": f"Tell me story number {i}."}]
        )
        body = {
            "model": "vlm",
            "messages": messages,
            "max_tokens": rng.randint(4, 40),
            "stream": True,
            "temperature": rng.choice([0.0, 0.8]),
        }
        leave_after = rng.choice([None, None, 2, 5])
        chunks = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            statuses.append(response.status_code)
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        break  # the client goes away mid-stream

    async with running_server(
        tiny_vlm_dir,
        served_model_names=("vlm",),
        max_num_seqs=6,
        admission="wait",
        max_waiting=32,
    ) as server:
        engine = server.state.engine
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            with trio.fail_after(240):
                async with trio.open_nursery() as nursery:
                    for i in range(24):
                        nursery.start_soon(one, i, client)
        await eventually(lambda: not engine.get_stats()["runner"]["live_sequences"])
        stats = engine.get_stats()
    assert statuses == [200] * 24
    runner = stats["runner"]
    assert runner["failed"] == 0 and runner["media_joined"] >= 6
    assert stats["running"] == stats["waiting"] == 0 and stats["slot_holders"] == []
    assert runner["requests_in_flight"] == 0 and runner["media_sequences"] == 0
    assert stats["kv_reserved_bytes"] == 0
