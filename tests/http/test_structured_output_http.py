"""`response_format` on /v1/chat/completions and `text.format` on /v1/responses, against the
server on the tiny random model (whose weights know no JSON: valid output is the grammar's),
through the official openai client and raw HTTP."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from idle import wait_until_idle
from servers import running_server
from trio_mlx.http.server import RunningServer

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Describe a city."}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "population", "capital"],
    "additionalProperties": False,
}
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


async def test_chat_json_schema_through_the_openai_client(client: openai.AsyncOpenAI) -> None:
    for strict in (True, False):
        reply = await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY, "strict": strict},
            },
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), CITY)


async def test_chat_json_object_starts_an_object_and_text_is_unconstrained(
    http: httpx.AsyncClient,
) -> None:
    body: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    reply = await http.post(CHAT, json={**body, "response_format": {"type": "json_object"}})
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["message"]["content"]
    assert content.startswith("{")
    if reply.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    plain = await http.post(CHAT, json={**body, "response_format": {"type": "text"}})
    default = await http.post(CHAT, json=body)
    assert plain.status_code == default.status_code == 200
    text = plain.json()["choices"][0]["message"]["content"]
    assert text == default.json()["choices"][0]["message"]["content"]
    assert not text.startswith("{")


async def test_streamed_chat_under_a_schema_joins_into_valid_json(http: httpx.AsyncClient) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "response_format": CHAT_FORMAT,
    }
    parts, finish = [], None
    async with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), CITY)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}},
        {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "strict": True,
                "schema": {"type": "string", "format": "no-such-format"},
            },
        },
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema"},
        {"type": "xml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}},
    ],
)
async def test_an_unusable_response_format_is_a_400_naming_it(
    http: httpx.AsyncClient, response_format: dict[str, Any]
) -> None:
    for stream in (False, True):
        reply = await http.post(
            CHAT, json={"messages": MESSAGES, "response_format": response_format, "stream": stream}
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"].startswith("response_format"), error
        assert error["type"] == "invalid_request_error"


async def test_the_openai_client_sees_an_uncompilable_schema_as_bad_request(
    client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "string", "minLength": 9, "maxLength": 1},
                },
            },
        )
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]
    assert caught.value.body["code"] == "invalid_output_format"  # type: ignore[index]


async def test_responses_text_format_json_schema(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model="tiny",
        input="Describe a city.",
        max_output_tokens=200,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)
    response = await client.responses.create(
        model="tiny",
        input="Describe a city.",
        max_output_tokens=12,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert response.output_text.startswith("{")


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}},
        {"type": "json_schema", "name": "x"},
        {"type": "yaml"},
    ],
)
async def test_an_unusable_text_format_is_a_400_naming_it(
    http: httpx.AsyncClient, fmt: dict[str, Any]
) -> None:
    reply = await http.post("/v1/responses", json={"input": "hi", "text": {"format": fmt}})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith("text.format")


@pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
async def test_a_client_leaving_mid_constrained_stream_frees_the_engine(
    tiny_model_dir: Any, max_num_seqs: int
) -> None:
    # a string of at least 10,000 characters: the grammar cannot end within max_tokens
    long_string = {"type": "string", "minLength": 10000}
    endless = {"type": "json_schema", "json_schema": {"name": "s", "schema": long_string}}
    async with running_server(tiny_model_dir, max_num_seqs=max_num_seqs) as server:
        engine = server.state.engine
        assert engine is not None
        body = {
            "messages": MESSAGES,
            "max_tokens": 900,
            "temperature": 1.0,
            "stream": True,
            "response_format": endless,
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            seen = 0
            async with http.stream("POST", CHAT, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen == 4:
                            break  # the client goes away
            stats = await wait_until_idle(engine)
            assert stats["runner"]["aborted"] == 1
            assert stats["runner"]["generated_tokens"] < 900
            reply = await http.post(
                CHAT,
                json={"messages": MESSAGES, "max_tokens": 200, "response_format": CHAT_FORMAT},
            )
            assert reply.status_code == 200
            content = reply.json()["choices"][0]["message"]["content"]
            jsonschema.validate(json.loads(content), CITY)


async def test_the_published_document_describes_structured_output(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        document = (await http.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    formats = json.dumps(schemas["ResponseFormat"])
    assert "json_schema" in formats and "json_object" in formats
    assert "schema" in json.dumps(schemas["JSONSchemaFormat"]["properties"])
