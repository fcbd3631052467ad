"""The published OpenAPI document (`/openapi.json`) says what the server does.

Regressions from the schemathesis run (tests/reliability/test_schemathesis.py):
- streamed answers did not match the document: `itemSchema` named the chunk model, but in
  OpenAPI 3.2 it describes one SSE event (`data`, `event`, ...), and `[DONE]` had no place in it;
- numbers like `2.0` were refused where the document says `integer` (JSON Schema's `integer` is
  any number without a fractional part);
- rules the server enforces in code but the document did not state (empty stop strings, a text
  part without `text`, a user message without content, `top_logprobs` without `logprobs`,
  negative token ids).
"""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema_rs  # the validator schemathesis uses (installed with it)
import pytest
import schemathesis
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
INPUT_TOKENS = "/v1/responses/input_tokens"
REQUEST_MODELS = {
    CHAT: "ChatCompletionRequest",
    COMPLETIONS: "CompletionRequest",
    RESPONSES: "ResponsesRequest",
    INPUT_TOKENS: "InputTokensRequest",
}


async def published(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    assert document["openapi"] == "3.2.0"
    return document


def request_validator(document: dict[str, Any], route: str) -> Any:
    schema = {
        "$ref": f"#/components/schemas/{REQUEST_MODELS[route]}",
        "components": document["components"],
    }
    return jsonschema_rs.Draft202012Validator(schema)


async def test_integers_may_be_written_as_floats(http: httpx.AsyncClient) -> None:
    body = {"prompt": [1.0, 2.0], "max_tokens": 2.0, "logprobs": 1.0, "seed": 7.0, "n": 1.0}
    response = await http.post(COMPLETIONS, json={**body, "top_k": 5.0})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == 2 and usage["completion_tokens"] == 2
    chat = {"messages": USER, "max_tokens": 2.0, "logprobs": True, "top_logprobs": 2.0}
    response = await http.post(CHAT, json=chat)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    response = await http.post(RESPONSES, json={"input": "hi", "max_output_tokens": 1e0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == 1
    # A fractional part, a boolean or a string is still not an integer.
    for value in (2.5, True, "2"):
        response = await http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": value})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (CHAT, {"messages": USER, "stop": [""]}, "stop"),
        (CHAT, {"messages": USER, "stop": ""}, "stop"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "system", "content": None}, *USER]}, "messages[0].content"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        (COMPLETIONS, {"prompt": [-1]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias.x"),
        (
            RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        (RESPONSES, {"input": "hi", "top_logprobs": 2}, "top_logprobs"),
        (RESPONSES, {"input": "hi", "include": ["nope"]}, "include[0]"),
        (
            RESPONSES,
            {"input": [{"type": "reasoning", "content": [{"type": "input_text", "text": "x"}]}]},
            "input[0].content[0]",
        ),
        (RESPONSES, {"input": [{"type": "reasoning", "content": "x"}]}, "input[0].content"),
        (INPUT_TOKENS, {}, "input"),
        (INPUT_TOKENS, {"instructions": ""}, "input"),
        (INPUT_TOKENS, {"input": None, "instructions": None}, "input"),
    ],
)
async def test_what_the_server_refuses_the_document_calls_invalid(
    http: httpx.AsyncClient, route: str, body: dict[str, Any], param: str
) -> None:
    response = await http.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not request_validator(await published(http), route).is_valid(body)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (CHAT, {"messages": [*USER, {"role": "assistant"}, {"role": "tool", "content": None}]}),
        (CHAT, {"messages": USER, "top_logprobs": 0}),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 3}),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "refusal"}]}]}),
        (COMPLETIONS, {"prompt": [0, 5], "logit_bias": {"7": -100}}),
        (
            RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
        ),
        (RESPONSES, {"input": "hi", "top_logprobs": 0}),
        (
            RESPONSES,
            {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3},
        ),
        (
            RESPONSES,
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {
                        "type": "reasoning",
                        "id": "rs-1",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": "x"}],
                    },
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "hi"},
                ]
            },
        ),
        (INPUT_TOKENS, {"input": "hi"}),
        (INPUT_TOKENS, {"instructions": "Be brief."}),
    ],
)
async def test_what_the_document_calls_valid_is_served(
    http: httpx.AsyncClient, route: str, body: dict[str, Any]
) -> None:
    assert request_validator(await published(http), route).is_valid(body)
    response = await http.post(route, json={**body, "max_tokens": 2, "max_output_tokens": 2})
    assert response.status_code == 200, response.text


STREAMS = [
    (CHAT, {"messages": USER, "max_tokens": 3, "stream": True}),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 3, "stream": True}),
    (RESPONSES, {"input": "hi", "max_output_tokens": 3, "stream": True}),
    (
        RESPONSES,
        {
            "input": "hi",
            "max_output_tokens": 3,
            "stream": True,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 2,
        },
    ),
]


@pytest.mark.parametrize(("route", "body"), STREAMS)
async def test_streams_match_the_documented_events(
    http: httpx.AsyncClient, route: str, body: dict[str, Any]
) -> None:
    operation = schemathesis.openapi.from_dict(await published(http))[route]["POST"]
    case = operation.Case(body=body, media_type="application/json")
    response = await http.post(route, json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    case.validate_response(response, checks=[response_schema_conformance])

    # The event schema is not a blank check: a changed event fails it.
    def altered(old: bytes, new: bytes) -> httpx.Response:
        assert old in response.content
        content = response.content.replace(old, new, 1)
        changed = httpx.Response(200, headers=response.headers, content=content)
        changed.request, changed.elapsed = response.request, response.elapsed
        return changed

    changes = [(b'"created"', b'"made"'), (b"[DONE]", b"[END]")]
    if route == RESPONSES:
        changes = [
            (b'"sequence_number":1', b'"sequence_number":"1"'),
            (b"event: response.", b"event: "),
        ]
    for old, new in changes:
        with pytest.raises(FailureGroup):
            case.validate_response(altered(old, new), checks=[response_schema_conformance])
