"""Building blocks of the OpenAPI document (`http/openapi.py`, `http/openapi_state.py`): schema
references, the error responses by status, a JSON operation, the Responses API's SSE framing."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from trio_mlx.http.objects import ErrorResponse

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


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def error_responses(*codes: str) -> dict[str, Any]:
    """The error responses of `codes` (`ERRORS` keys; `404-response` is a 404 of its own)."""
    return {
        code.split("-")[0]: {
            "description": ERRORS[code],
            "content": {"application/json": {"schema": ref(ErrorResponse)}},
        }
        for code in codes
    }


def json_operation(summary: str, result: dict[str, Any], *errors: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "responses": {
            "200": {"description": "Success", "content": {"application/json": {"schema": result}}}
        }
        | error_responses(*errors),
    }


def json_text(schema: dict[str, Any]) -> dict[str, Any]:
    """A string holding JSON that matches `schema` (an SSE event's `data`)."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


def named_event_stream(event: type[BaseModel]) -> dict[str, Any]:
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
                "data": json_text(ref(event)),
            },
        },
    }
