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
from trio_mlx.http.requests import ChatCompletionRequest, CompletionRequest
from trio_mlx.http.responses.requests import InputTokensRequest, ResponsesRequest

REF = "#/components/schemas/{model}"

ERRORS = {
    "400": "Invalid request: malformed JSON, a wrong type or value (`param` names the field), "
    "a prompt that does not fit the context",
    "404": "Unknown model",
    "404-response": "No stored or background response has this id (never made, `store` false, "
    "evicted, deleted)",
    "404-conversation": "No conversation has this id (never made, deleted, evicted)",
    "404-item": "No conversation has this id, or it holds no item of this id",
    "413": "Request body too large",
    "415": "Content-Type is not application/json",
    "429": "Admission refused: the engine is busy (see Retry-After)",
    "529": "Admission refused: the engine is busy (see Retry-After); Anthropic's status for an "
    "overloaded service, on the Messages routes",
    "500": "Internal error",
    "503": "The model is loading, or the engine is shutting down or dead",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(*codes: str) -> dict[str, Any]:
    """The error responses of `codes` (`ERRORS` keys; `404-response` is a 404 of its own)."""
    return {
        code.split("-")[0]: {
            "description": ERRORS[code],
            "content": {"application/json": {"schema": _ref(ErrorResponse)}},
        }
        for code in codes
    }


#: The path parameter of the stored-response routes.
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


#: The query of the item lists (a stored response's input items, a conversation's).
ITEMS_QUERY = [
    {
        "name": "after",
        "in": "query",
        "required": False,
        "description": "List the items after the item with this id (the next page).",
        "schema": {"type": "string"},
    },
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
    },
    {
        "name": "order",
        "in": "query",
        "required": False,
        "schema": {"enum": ["asc", "desc"], "default": "desc"},
    },
]


def _stored_response_paths() -> dict[str, Any]:
    """`GET` and `DELETE /v1/responses/{response_id}`, `GET .../input_items`."""
    query = ITEMS_QUERY
    resume = [
        {
            "name": "stream",
            "in": "query",
            "required": False,
            "description": "`true`: the events of a response created with `background` and "
            "`stream`, as it runs or after it has ended",
            "schema": {"enum": ["true", "false"]},
        },
        {
            "name": "starting_after",
            "in": "query",
            "required": False,
            "description": "With `stream`: the events after the one of this `sequence_number`",
            "schema": {"type": "integer"},
        },
    ]
    retrieved = _get(
        "A stored response (`store`), or a background one as it stands (`queued`, "
        "`in_progress` with its output so far, then as it ended)",
        _ref(ResponseObject),
        "400",
        "404-response",
    )
    retrieved["responses"]["200"]["content"]["text/event-stream"] = _named_event_stream(
        ResponseStreamEvent
    )
    return {
        "/v1/responses/{response_id}": {
            "parameters": [RESPONSE_ID],
            "get": retrieved | {"parameters": resume},
            "delete": _get(
                "Delete a stored response (a background one that runs is cancelled)",
                _ref(ResponseDeleted),
                "404-response",
            ),
        },
        "/v1/responses/{response_id}/cancel": {
            "parameters": [RESPONSE_ID],
            "post": _get(
                "Cancel a background response: it ends `cancelled` with the output written so "
                "far; one that has ended is returned as it ended; 400 for a response not "
                "created with `background`",
                _ref(ResponseObject),
                "400",
                "404-response",
            ),
        },
        "/v1/responses/{response_id}/input_items": {
            "parameters": [RESPONSE_ID],
            "get": _get(
                "A stored response's input items, a page at a time: the conversation before "
                "its output (the earlier turns' items included)",
                _ref(ResponseItemList),
                "400",
                "404-response",
            )
            | {"parameters": query},
        },
    }


#: The path parameters of the conversation routes.
CONVERSATION_ID = {
    "name": "conversation_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
}
ITEM_ID = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _with_body(operation: dict[str, Any], body: type[BaseModel], *errors: str) -> dict[str, Any]:
    """`operation` (`_get`'s) taking a JSON `body`, with the errors of reading one."""
    operation["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": _ref(body)}},
    }
    operation["responses"] |= _errors("400", "413", "415", *errors)
    return operation


def _conversation_paths() -> dict[str, Any]:
    """The Conversations API: `/v1/conversations` and its items."""
    item = {"type": "object", "required": ["id", "type"]}
    return {
        "/v1/conversations": {
            "post": _with_body(
                _get(
                    "Create a conversation, with its first `items` (at most 20) and `metadata`",
                    _ref(ConversationObject),
                ),
                ConversationCreateRequest,
            )
        },
        "/v1/conversations/{conversation_id}": {
            "parameters": [CONVERSATION_ID],
            "get": _get("A conversation", _ref(ConversationObject), "404-conversation"),
            "post": _with_body(
                _get(
                    "Replace a conversation's `metadata`",
                    _ref(ConversationObject),
                    "404-conversation",
                ),
                ConversationUpdateRequest,
            ),
            "delete": _get(
                "Delete a conversation and its items",
                _ref(ConversationDeleted),
                "404-conversation",
            ),
        },
        "/v1/conversations/{conversation_id}/items": {
            "parameters": [CONVERSATION_ID],
            "post": _with_body(
                _get(
                    "Append items (at most 20) to a conversation; the items as added, each "
                    "with its `id`",
                    _ref(ResponseItemList),
                    "404-conversation",
                ),
                ConversationItemsRequest,
            ),
            "get": _get(
                "A conversation's items, a page at a time (`desc`, the newest first, by default)",
                _ref(ResponseItemList),
                "400",
                "404-conversation",
            )
            | {"parameters": ITEMS_QUERY},
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "parameters": [CONVERSATION_ID, ITEM_ID],
            "get": _get("One item of a conversation", item, "404-item"),
            "delete": _get(
                "Delete one item of a conversation; the conversation",
                _ref(ConversationObject),
                "404-item",
            ),
        },
    }


def _json_ok(model: type[BaseModel], stream: dict[str, Any] | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(model)}}
    if stream is not None:
        content["text/event-stream"] = stream
    return {"200": {"description": "Success", "content": content}}


def _json_text(schema: dict[str, Any]) -> dict[str, Any]:
    """A string holding JSON that matches `schema` (an SSE event's `data`)."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


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
                    "else": _json_text({"anyOf": [_ref(chunk), _ref(ErrorResponse)]}),
                }
            },
        },
    }


def _named_event_stream(event: type[BaseModel]) -> dict[str, Any]:
    """The Responses API's SSE framing: `event: response.<...>` (the `type` of the data) and
    `data:` the event's JSON; no `[DONE]`."""
    return {
        "description": f"With `stream: true`: server-sent events, each named by its type "
        f"(`event:`) with a {event.__name__} as `data`",
        "itemSchema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string", "pattern": r"^response\.[a-z_.]+$"},
                "data": _json_text(_ref(event)),
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
                "data": _json_text({"anyOf": [_ref(model) for model in STREAM_EVENTS]}),
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
    content: dict[str, Any] = {"application/json": {"schema": _ref(result)}}
    if stream is not None:
        content["text/event-stream"] = stream
    errors = {
        code: {
            "description": ERRORS[code],
            "content": {"application/json": {"schema": _ref(AnthropicError)}},
        }
        for code in ("400", "404", "413", "415", "500", "503", "529")
    }
    return {
        "post": {
            "summary": summary,
            "parameters": ANTHROPIC_HEADERS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(body)}},
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
                "content": {"application/json": {"schema": _ref(body)}},
            },
            "responses": _json_ok(result, stream)
            | _errors("400", "404", "413", "415", "429", "500", "503"),
        }
    }


def _get(summary: str, result: dict[str, Any], *errors: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "responses": {
            "200": {"description": "Success", "content": {"application/json": {"schema": result}}}
        }
        | _errors(*errors),
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
            _named_event_stream(ResponseStreamEvent),
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
                        "content": {"application/json": {"schema": _ref(ErrorResponse)}},
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
                    "content": {"application/json": {"schema": _ref(InputTokensRequest)}},
                },
                "responses": _json_ok(InputTokenCount)
                | _errors("400", "404", "413", "415", "500", "503"),
            }
        },
        **_stored_response_paths(),
        **_conversation_paths(),
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
            "get": _get(
                "The served model and its aliases (to a request with an `anthropic-version` "
                "header, as Anthropic lists models: a page `{data, has_more, first_id, last_id}` "
                "of `{type: model, id, display_name, created_at}`, paged by `limit`, `after_id`, "
                "`before_id`)",
                _ref(ModelList),
                "503",
            )
        },
        "/v1/models/{model}": {
            "get": _get(
                "One model (Anthropic's shape to a request with an `anthropic-version` header)",
                _ref(ModelCard),
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
                        "content": {"application/json": {"schema": _ref(Health)}},
                    },
                    "503": {
                        "description": "Not ready",
                        "content": {"application/json": {"schema": _ref(Health)}},
                    },
                },
            }
        },
        "/v1/status": {"get": _get("Live engine statistics", any_object, "503")},
        "/v1/cache/stats": {"get": _get("Prefix KV-cache statistics", any_object, "503")},
        "/v1/cache": {"delete": _get("Drop every cached prefix", any_object, "503")},
        "/openapi.json": {"get": _get("This document", any_object)},
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
            "content": {"application/json": {"schema": _ref(ErrorResponse)}},
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
