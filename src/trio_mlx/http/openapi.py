"""The OpenAPI 3.2 document of the server, generated from the request and response models.

Each route lists its request body, its success responses (JSON, and where it streams the SSE
events, described one by one with OpenAPI 3.2's `itemSchema`) and the error responses it can give,
all in the OpenAI error shape; the Anthropic Messages routes (`/v1/messages`) in Anthropic's
shapes, their errors included.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from trio_mlx.http.anthropic.objects import STREAM_EVENTS, AnthropicError, Message, TokenCount
from trio_mlx.http.anthropic.requests import CountTokensRequest, MessagesRequest
from trio_mlx.http.conversations.requests import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
)
from trio_mlx.http.objects import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ConversationDeleted,
    ConversationObject,
    ErrorResponse,
    Health,
    InputTokenCount,
    ModelCard,
    ModelList,
    ResponseDeleted,
    ResponseItemList,
    ResponseObject,
    ResponseStreamEvent,
)
from trio_mlx.http.openapi_parts import (
    ERRORS,
    REF,
    error_responses,
    json_operation,
    json_text,
    named_event_stream,
    ref,
)
from trio_mlx.http.openapi_state import conversation_paths, stored_response_paths
from trio_mlx.http.requests import ChatCompletionRequest, CompletionRequest
from trio_mlx.http.responses.requests import InputTokensRequest, ResponsesRequest


def _json_ok(model: type[BaseModel], stream: dict[str, Any] | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": ref(model)}}
    if stream is not None:
        content["text/event-stream"] = stream
    return {"200": {"description": "Success", "content": content}}


def _data_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """OpenAI's SSE framing (chat and completions): `data:` events of `chunk` JSON, an error
    object if the request fails after the stream began, and `data: [DONE]` last. In OpenAPI 3.2
    `itemSchema` describes one event as an object of its fields (`data`, `event`, `id`, `retry`)."""
    return {
        "description": f"With `stream: true`: server-sent events whose `data` is a "
        f"{chunk.__name__} (or an error object if generation fails mid-stream), then "
        "`data: [DONE]`",
        "itemSchema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "if": {"const": "[DONE]"},
                    "else": json_text({"anyOf": [ref(chunk), ref(ErrorResponse)]}),
                }
            },
        },
    }


def _anthropic_stream() -> dict[str, Any]:
    """Anthropic's SSE framing: `event:` the name of the event (the `type` of its data), `data:`
    the event's JSON; an `error` event if generation fails mid-stream; no `[DONE]`."""
    names = [model.model_fields["type"].default for model in STREAM_EVENTS]
    return {
        "description": "With `stream: true`: server-sent events `message_start`, "
        "`content_block_start`, `ping`, `content_block_delta`..., `content_block_stop`, "
        "`message_delta`, `message_stop` (or `error`), each named by its type",
        "itemSchema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"enum": names},
                "data": json_text({"anyOf": [ref(model) for model in STREAM_EVENTS]}),
            },
        },
    }


#: Headers Anthropic clients send: accepted, never required (no key is checked here).
ANTHROPIC_HEADERS = [
    {"name": name, "in": "header", "required": False, "schema": {"type": "string"}}
    for name in ("x-api-key", "anthropic-version", "anthropic-beta")
]


def _anthropic(
    summary: str,
    body: type[BaseModel],
    result: type[BaseModel],
    stream: dict[str, Any] | None = None,
) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": ref(result)}}
    if stream is not None:
        content["text/event-stream"] = stream
    errors = {
        code: {
            "description": ERRORS[code],
            "content": {"application/json": {"schema": ref(AnthropicError)}},
        }
        for code in ("400", "404", "413", "415", "500", "503", "529")
    }
    return {
        "post": {
            "summary": summary,
            "parameters": ANTHROPIC_HEADERS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref(body)}},
            },
            "responses": {"200": {"description": "Success", "content": content}} | errors,
        }
    }


def _generation(
    summary: str, body: type[BaseModel], result: type[BaseModel], stream: dict[str, Any]
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref(body)}},
            },
            "responses": _json_ok(result, stream)
            | error_responses("400", "404", "413", "415", "429", "500", "503"),
        }
    }


@cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.2 document (built once)."""
    models: list[type[BaseModel]] = [
        ChatCompletionRequest,
        CompletionRequest,
        ResponsesRequest,
        InputTokensRequest,
        MessagesRequest,
        CountTokensRequest,
        Message,
        TokenCount,
        *STREAM_EVENTS,
        ChatCompletion,
        ChatCompletionChunk,
        Completion,
        ResponseObject,
        ResponseStreamEvent,
        InputTokenCount,
        ResponseDeleted,
        ResponseItemList,
        ConversationCreateRequest,
        ConversationUpdateRequest,
        ConversationItemsRequest,
        ConversationObject,
        ConversationDeleted,
        ModelList,
        ModelCard,
        Health,
        ErrorResponse,
    ]
    _, schemas = models_json_schema(
        [(m, "validation" if m.__name__.endswith("Request") else "serialization") for m in models],
        ref_template=REF,
    )
    any_object = {"type": "object"}
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation(
            "Chat completion",
            ChatCompletionRequest,
            ChatCompletion,
            _data_stream(ChatCompletionChunk),
        ),
        "/v1/completions": _generation(
            "Text completion", CompletionRequest, Completion, _data_stream(Completion)
        ),
        "/v1/responses": _generation(
            "Create a response",
            ResponsesRequest,
            ResponseObject,
            named_event_stream(ResponseStreamEvent),
        )
        | {
            "get": {
                "summary": "WebSocket mode (Upgrade: websocket): send `response.create` messages "
                "(the fields of the POST body plus `type`), receive the stream's events; bad "
                "messages get `error` events and the connection stays open",
                "responses": {
                    "101": {"description": "Switching to the WebSocket protocol"},
                    "405": {
                        "description": "Not a WebSocket upgrade request",
                        "content": {"application/json": {"schema": ref(ErrorResponse)}},
                    },
                },
            }
        },
        "/v1/responses/input_tokens": {
            "post": {
                "summary": "Count the input tokens of a response: the prompt `POST /v1/responses` "
                "would prefill for the same `input`, `instructions`, `tools` and "
                "`previous_response_id` or `conversation`",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": ref(InputTokensRequest)}},
                },
                "responses": _json_ok(InputTokenCount)
                | error_responses("400", "404", "413", "415", "500", "503"),
            }
        },
        **stored_response_paths(),
        **conversation_paths(),
        "/v1/messages": _anthropic(
            "Anthropic Messages API: create a message",
            MessagesRequest,
            Message,
            _anthropic_stream(),
        ),
        "/v1/messages/count_tokens": _anthropic(
            "Anthropic Messages API: count a conversation's prompt tokens",
            CountTokensRequest,
            TokenCount,
        ),
        "/v1/models": {
            "get": json_operation(
                "The served model and its aliases (to a request with an `anthropic-version` "
                "header, as Anthropic lists models: a page `{data, has_more, first_id, last_id}` "
                "of `{type: model, id, display_name, created_at}`, paged by `limit`, `after_id`, "
                "`before_id`)",
                ref(ModelList),
                "503",
            )
        },
        "/v1/models/{model}": {
            "get": json_operation(
                "One model (Anthropic's shape to a request with an `anthropic-version` header)",
                ref(ModelCard),
                "404",
                "503",
            )
            | {
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ]
            }
        },
        "/health": {
            "get": {
                "summary": "200 when ready; 503 while loading, draining or dead",
                "responses": {
                    "200": {
                        "description": "Ready",
                        "content": {"application/json": {"schema": ref(Health)}},
                    },
                    "503": {
                        "description": "Not ready",
                        "content": {"application/json": {"schema": ref(Health)}},
                    },
                },
            }
        },
        "/v1/status": {"get": json_operation("Live engine statistics", any_object, "503")},
        "/v1/cache/stats": {"get": json_operation("Prefix KV-cache statistics", any_object, "503")},
        "/v1/cache": {"delete": json_operation("Drop every cached prefix", any_object, "503")},
        "/openapi.json": {"get": json_operation("This document", any_object)},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition format, trio_mlx: namespace)",
                "responses": {
                    "200": {
                        "description": "Success",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        paths[path]["post"]["responses"]["404"] = {
            "description": "Unknown model, or no conversation has the id of `conversation`",
            "content": {"application/json": {"schema": ref(ErrorResponse)}},
        }
    return {
        "openapi": "3.2.0",
        "info": {
            "title": "trio-mlx",
            "version": _version(),
            "description": "OpenAI-compatible LLM server on MLX, with the Anthropic Messages "
            'API under /v1/messages. Errors are `{"error": {"message", "type", "param", '
            '"code"}}`; under /v1/messages, `{"type": "error", "error": {"type", "message"}}`.',
        },
        "paths": paths,
        "components": {"schemas": schemas["$defs"]},
    }


def _version() -> str:
    try:
        return version("trio-mlx")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"
