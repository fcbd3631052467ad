"""Image blocks on /v1/messages with the official `anthropic` client, against a server on the tiny
random Qwen2-VL: the image reaches the model through the engine's multimodal path (the answer
is the chat route's for the same image), bad images are 400s naming the block's source in
Anthropic's shape; an image in a tool result reaches a model whose template renders tool
messages, and is refused where results are written into the prompt as text. (A text-only
model's refusal is in test_anthropic_http.py.)"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from media_samples import data_url, image_message, media_server, png
from servers import running_server
from trio_mlx.http.server import RunningServer
from trio_mlx.multimodal.media import MediaPolicy

QUESTION = "What is in this image?"


def image_block(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": encoded},
    }


def asking(*blocks: dict[str, Any]) -> Any:
    return [{"role": "user", "content": [*blocks, {"type": "text", "text": QUESTION}]}]


@pytest.fixture
async def vlm_server(tiny_vlm_dir: Path) -> AsyncIterator[RunningServer]:
    async with running_server(tiny_vlm_dir, served_model_names=("vlm",)) as server:
        yield server


def claude_for(server: RunningServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=60
    )


async def answer(claude: anthropic.AsyncAnthropic, messages: Any) -> str:
    reply = await claude.messages.create(
        model="vlm", max_tokens=8, messages=messages, extra_body={"temperature": 0}
    )
    assert reply.content[0].type == "text"
    return reply.content[0].text


async def chat_answer(server: RunningServer, url: str) -> str:
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        reply = await client.chat.completions.create(
            model="vlm",
            messages=image_message(url, QUESTION),  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
        )
    return reply.choices[0].message.content or ""


async def test_an_image_block_changes_the_answer_as_the_chat_route_sees_it(
    vlm_server: RunningServer,
) -> None:
    async with claude_for(vlm_server) as claude:
        seen = await answer(claude, asking(image_block(png(0))))
        other = await answer(claude, asking(image_block(png(1))))
        blind = await answer(claude, asking())
        counted = await claude.messages.count_tokens(
            model="vlm", messages=asking(image_block(png(0)))
        )
        bare = await claude.messages.count_tokens(model="vlm", messages=asking())
    assert seen != blind and seen != other
    assert seen == await chat_answer(vlm_server, data_url(png(0)))
    assert counted.input_tokens > bare.input_tokens + 4  # the image's tokens are counted


async def test_a_url_source_is_fetched_as_a_chat_image_url_is(tiny_vlm_dir: Path) -> None:
    policy = MediaPolicy(allow_private_urls=True)
    async with (
        media_server({"a.png": png(0)}) as (base, _arrived),
        running_server(tiny_vlm_dir, served_model_names=("vlm",), media=policy) as server,
        claude_for(server) as claude,
    ):
        by_url = await answer(
            claude, asking({"type": "image", "source": {"type": "url", "url": f"{base}/a.png"}})
        )
        inline = await answer(claude, asking(image_block(png(0))))
    assert by_url == inline


@pytest.mark.parametrize(
    ("source", "field"),
    [
        (image_block(b"definitely not a picture")["source"], "messages.1.content.0.source: "),
        (
            {"type": "base64", "media_type": "image/png", "data": "@@@"},
            "messages.1.content.0.source: ",
        ),
        (
            {"type": "base64", "media_type": "image/tiff", "data": "AAAA"},
            "messages.1.content.0.source.media_type: ",
        ),
        ({"type": "url", "url": "http://127.0.0.1:9/private.png"}, "messages.1.content.0.source: "),
        ({"type": "url", "url": "/etc/hostname"}, "messages.1.content.0.source: "),
        ({"type": "file", "file_id": "f"}, "messages.1.content.0.source.type: "),
    ],
)
async def test_bad_images_are_400_naming_the_source(
    vlm_server: RunningServer, source: dict[str, Any], field: str
) -> None:
    # A string turn first, merged with the image's turn: the field is still the request's own.
    messages: Any = [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "image", "source": source}]},
    ]
    async with claude_for(vlm_server) as claude:
        for counting in (False, True):
            with pytest.raises(anthropic.BadRequestError) as refused:
                if counting:
                    await claude.messages.count_tokens(model="vlm", messages=messages)
                else:
                    await claude.messages.create(model="vlm", max_tokens=4, messages=messages)
            body: Any = refused.value.body
            assert body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith(field), body


def with_template_that_knows_tools(vlm_dir: Path, out_dir: Path) -> Path:
    """A copy of the tiny VLM whose chat template names `tools` (it renders tool messages as any
    other turn, images included), as tool-aware VLM templates (Qwen2.5-VL's) do."""
    shutil.copytree(vlm_dir, out_dir)
    template = out_dir / "chat_template.json"
    data = json.loads(template.read_text())
    data["chat_template"] = "{# no tools are offered #}" + data["chat_template"]
    template.write_text(json.dumps(data))
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text("{# no tools are offered #}" + jinja.read_text())
    return out_dir


SHOT: Any = [{"name": "screenshot", "input_schema": {"type": "object"}}]


def shot_result(*blocks: dict[str, Any]) -> Any:
    """A tool loop whose tool result holds `blocks`."""
    return [
        {"role": "user", "content": "Take a screenshot."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": list(blocks)}],
        },
    ]


async def test_an_image_in_a_tool_result_reaches_a_model_whose_template_renders_tool_messages(
    tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    caption = {"type": "text", "text": "Here it is."}
    model_dir = with_template_that_knows_tools(tiny_vlm_dir, tmp_path / "vlm-tools")
    async with (
        running_server(model_dir, served_model_names=("vlm",)) as server,
        claude_for(server) as claude,
    ):

        async def answer_to(*blocks: dict[str, Any]) -> str:
            reply = await claude.messages.create(
                model="vlm",
                max_tokens=8,
                tools=SHOT,
                messages=shot_result(*blocks),
                extra_body={"temperature": 0},
            )
            assert reply.content[0].type == "text"
            return reply.content[0].text

        seen = await answer_to(caption, image_block(png(0)))
        assert seen != await answer_to(caption, image_block(png(1)))
        assert seen != await answer_to(caption)
        # The chat route's tool message with the same parts is the same prompt.
        chat = {
            "model": "vlm",
            "max_tokens": 8,
            "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "screenshot", "parameters": {}}}],
            "messages": [
                {"role": "user", "content": "Take a screenshot."},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "type": "function",
                            "function": {"name": "screenshot", "arguments": "{}"},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "toolu_1",
                    "content": [
                        {"type": "text", "text": "Here it is."},
                        {"type": "image_url", "image_url": {"url": data_url(png(0))}},
                    ],
                },
            ],
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            reply = await http.post("/v1/chat/completions", json=chat)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == seen
        bad = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/bmp", "data": "A"},
        }
        with pytest.raises(anthropic.BadRequestError) as refused:
            await answer_to(caption, bad)
        message = str(refused.value.body["error"]["message"])  # type: ignore[index]
        assert message.startswith("messages.2.content.0.content.1.source.media_type: ")


async def test_an_image_in_a_tool_result_is_refused_where_tool_messages_become_text(
    vlm_server: RunningServer,
) -> None:
    # The tiny VLM's template knows no tools: results are written into the prompt as text.
    async with claude_for(vlm_server) as claude:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(
                model="vlm",
                max_tokens=4,
                tools=SHOT,
                messages=shot_result({"type": "text", "text": "Here."}, image_block(png(0))),
            )
    message = str(refused.value.body["error"]["message"])  # type: ignore[index]
    assert message.startswith("messages.2.content.0.content.1: ")
    assert "does not render tool messages" in message
