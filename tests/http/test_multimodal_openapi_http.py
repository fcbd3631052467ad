"""The published OpenAPI document describes the media the server takes: chat's `image_url` and
`video_url` parts, Responses' `input_image`, Anthropic's `image` block (base64 and url sources).

Against a server on the tiny random Qwen2-VL: a real request with media that the document calls
valid is served (200), one it calls invalid is refused (400 naming the part), and the document's
part and block types are the ones the request models and the media reader take.
"""

from __future__ import annotations

import base64
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs  # the validator schemathesis uses (installed with it)
import pytest

from media_samples import data_url, png, write_video
from servers import running_server
from trio_mlx.http.anthropic.requests import IMAGE_MEDIA_TYPES, MessagesRequest
from trio_mlx.http.requests import ChatCompletionRequest, ContentPart
from trio_mlx.http.responses.requests import ResponsesRequest
from trio_mlx.multimodal.media import MediaPolicy
from trio_mlx.multimodal.parts import MEDIA_PARTS

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
REQUEST_MODELS = {
    CHAT: ChatCompletionRequest,
    RESPONSES: ResponsesRequest,
    MESSAGES: MessagesRequest,
}
QUESTION = {"type": "text", "text": "What is in this image?"}
PNG = png(0)
PNG_B64 = base64.b64encode(PNG).decode()


@pytest.fixture
async def vlm(tiny_vlm_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Path]]:
    write_video(tmp_path / "clip.avi", frames=4)
    (tmp_path / "a.png").write_bytes(PNG)
    policy = MediaPolicy(allowed_local_dir=tmp_path)
    async with running_server(tiny_vlm_dir, media=policy) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            yield http, tmp_path


def validator(document: dict[str, Any], route: str) -> Any:
    schema = {
        "$ref": f"#/components/schemas/{REQUEST_MODELS[route].__name__}",
        "components": document["components"],
    }
    return jsonschema_rs.Draft202012Validator(schema)


def chat_body(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [*parts, QUESTION]}], "max_tokens": 2}


def responses_body(*parts: dict[str, Any]) -> dict[str, Any]:
    content = [*parts, {"type": "input_text", "text": "What is in this image?"}]
    return {"input": [{"role": "user", "content": content}], "max_output_tokens": 2}


def messages_body(*blocks: dict[str, Any], role: str = "user") -> dict[str, Any]:
    turns = [{"role": role, "content": [*blocks, QUESTION]}]
    if role == "assistant":
        turns.insert(0, {"role": "user", "content": "hi"})
    return {"messages": turns, "max_tokens": 2}


def base64_block(media_type: str = "image/png", data: str = PNG_B64) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def served_cases(media_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    image = data_url(PNG)
    return [
        (CHAT, chat_body({"type": "image_url", "image_url": {"url": image, "detail": "low"}})),
        (CHAT, chat_body({"type": "image_url", "image_url": str(media_dir / "a.png")})),
        (CHAT, chat_body({"type": "video_url", "video_url": {"url": str(media_dir / "clip.avi")}})),
        (RESPONSES, responses_body({"type": "input_image", "image_url": image})),
        (MESSAGES, messages_body(base64_block())),
        (MESSAGES, messages_body({"type": "image", "source": {"type": "url", "url": image}})),
    ]


async def test_requests_with_media_are_valid_by_the_document_and_served(
    vlm: tuple[httpx.AsyncClient, Path],
) -> None:
    http, media_dir = vlm
    document = (await http.get("/openapi.json")).json()
    for route, body in served_cases(media_dir):
        errors = [e.message for e in validator(document, route).iter_errors(body)]
        assert errors == [], (route, body, errors)
        REQUEST_MODELS[route].model_validate(body)  # the request model takes it too
        response = await http.post(route, json=body)
        assert response.status_code == 200, (route, response.text)
        usage = response.json()["usage"]
        prompt = usage.get("prompt_tokens") or (  # Anthropic's counts cached tokens apart
            usage["input_tokens"]
            + usage.get("cache_read_input_tokens", 0)
            + usage.get("cache_creation_input_tokens", 0)
        )
        assert prompt > 10, (route, usage)  # the media tokens are in the prompt


def refused_cases() -> list[tuple[str, dict[str, Any], str]]:
    """(route, body, the field the 400 names: `param`, or the head of Anthropic's message)."""
    return [
        (CHAT, chat_body({"type": "image_url"}), "messages[0].content[0].image_url"),
        (
            CHAT,
            chat_body({"type": "image_url", "image_url": {"url": ""}}),
            "messages[0].content[0].image_url",
        ),
        (CHAT, chat_body({"type": "video_url", "video_url": ""}), "messages[0].content[0]"),
        (CHAT, chat_body({"type": "input_audio"}), "messages[0].content[0].type"),
        (RESPONSES, responses_body({"type": "input_image"}), "input[0].content[0].image_url"),
        (MESSAGES, messages_body({"type": "image"}), "messages.0.content.0.source"),
        (
            MESSAGES,
            messages_body(base64_block(media_type="image/bmp")),
            "messages.0.content.0.source.media_type",
        ),
        (MESSAGES, messages_body(base64_block(data="")), "messages.0.content.0.source.data"),
        (
            MESSAGES,
            messages_body({"type": "image", "source": {"type": "url"}}),
            "messages.0.content.0.source.url",
        ),
        (
            MESSAGES,
            messages_body({"type": "image", "source": {"type": "file", "file_id": "f"}}),
            "messages.0.content.0.source.type",
        ),
        (MESSAGES, messages_body(base64_block(), role="assistant"), "messages.1.content.0"),
    ]


async def test_media_the_document_calls_invalid_is_refused_naming_the_part(
    vlm: tuple[httpx.AsyncClient, Path],
) -> None:
    http, _ = vlm
    document = (await http.get("/openapi.json")).json()
    for route, body, field in refused_cases():
        assert not validator(document, route).is_valid(body), (route, body)
        response = await http.post(route, json=body)
        assert response.status_code == 400, (route, body, response.text)
        error = response.json()["error"]
        named = error["message"] if route == MESSAGES else error["param"]
        assert named.startswith(field), (route, body, error)


def test_the_document_lists_the_part_types_the_models_and_the_media_reader_take() -> None:
    from trio_mlx.http.openapi import openapi_document

    schemas = openapi_document()["components"]["schemas"]
    parsed = set(typing.get_args(ContentPart.model_fields["type"].annotation))
    listed = set(schemas["ContentPart"]["properties"]["type"]["enum"])
    assert listed == parsed - {"input_audio"}  # parsed, but refused: no audio models here
    media = {kind for kind in listed if kind in MEDIA_PARTS}
    assert media == {"image_url", "input_image", "video_url"}
    # each media part's source field is the one the media reader takes, and is required
    for rule in schemas["ContentPart"]["allOf"]:
        for kind in rule["if"]["properties"]["type"]["enum"]:
            if kind in MEDIA_PARTS:
                assert rule["then"]["required"] == [MEDIA_PARTS[kind][1]]
    assert "image" in schemas["ContentBlock"]["properties"]["type"]["enum"]
    image_rule = next(
        rule
        for rule in schemas["ContentBlock"]["allOf"]
        if rule["if"]["properties"]["type"] == {"const": "image"}
    )
    base64_source, url_source = image_rule["then"]["properties"]["source"]["oneOf"]
    assert base64_source["properties"]["media_type"]["enum"] == list(IMAGE_MEDIA_TYPES)
    assert url_source["required"] == ["type", "url"]


async def test_media_in_a_tool_result_is_refused_where_the_template_writes_results_as_text(
    vlm: tuple[httpx.AsyncClient, Path],
) -> None:
    # The tiny VLM's template renders no tool messages: results become prompt text, which cannot
    # hold an image (it was written out as the part's repr). A 400 naming the part instead.
    http, _ = vlm
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    image = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    body = {
        "messages": [
            {"role": "user", "content": "Look."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": [QUESTION, image]},
        ],
        "max_tokens": 2,
    }
    response = await http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[2].content[1]"
    text_only = {"role": "tool", "tool_call_id": "c1", "content": [QUESTION]}
    response = await http.post(CHAT, json={**body, "messages": [*body["messages"][:2], text_only]})
    assert response.status_code == 200, response.text
