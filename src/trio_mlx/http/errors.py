"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`, always JSON.

`APIError` is what route code raises; `parse_json` reads a body or a WebSocket message (a 400 when
it is not JSON); `from_engine_error` maps the engine's exceptions (refusals, bad requests, a dead
engine) to their HTTP status, and `from_validation_error` turns a pydantic validation failure
into a 400 whose `param` names the offending field (`messages[0].content`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from trio_mlx.errors import (
    EngineBusy,
    EngineClosed,
    EngineCrashed,
    InvalidRequest,
    PromptTooLong,
    TrioMLXError,
)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"
UNAVAILABLE = "service_unavailable"


class APIError(Exception):
    """An error response: HTTP `status` with the OpenAI error body (and extra headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code or default_code(status)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {...}}`."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


#: The `code` of an error raised without one, by status: every error body names a code.
DEFAULT_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "unavailable",
}


def default_code(status: int) -> str:
    """The `code` for an error of `status` raised without one."""
    return DEFAULT_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_engine_error(exc: TrioMLXError) -> APIError:
    """The HTTP answer to an engine exception raised before a response started."""
    if isinstance(exc, PromptTooLong):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineBusy):
        retry = max(1, round(exc.retry_after))
        return APIError(
            429,
            str(exc),
            type=OVERLOADED,
            code=exc.code,
            headers={"Retry-After": str(retry)},
        )
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), type=UNAVAILABLE, code=exc.code)
    if isinstance(exc, EngineCrashed):
        return APIError(503, str(exc), type=UNAVAILABLE, code=exc.code)
    return APIError(500, str(exc), type=SERVER_ERROR, code=exc.code)


def required_text(fields: Mapping[str, Any], key: str, message: str, param: str) -> str:
    """`fields[key]` when it is a non-empty string; else a 400 `missing_required_parameter`
    naming `param`, saying `message`."""
    value = fields.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, message, param=param, code="missing_required_parameter")
    return value


def parse_json(raw: str | bytes, what: str) -> Any:
    """`raw` read as JSON; malformed (or nested too deeply for Python) it is a 400 naming
    `what` ("body", "message")."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the {what} is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the {what} is nested too deeply", code="invalid_json") from None


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 for the first field that failed, `param` naming it. Where the field takes several
    shapes (a string or a list of blocks), pydantic reports a failure per shape: the one told is
    the shape the client sent (a failure that is no type mismatch, else the deepest one), so
    that a list of five stop strings reads "at most 4 items", not "a valid string"."""
    errors = exc.errors(include_url=False)
    where = tuple(errors[0].get("loc", ()))
    cut = next((i for i, part in enumerate(where) if _is_union_tag(part)), len(where))
    shapes = [error for error in errors if tuple(error.get("loc", ()))[:cut] == where[:cut]]
    first = max(shapes, key=_relevance)  # max keeps the first of equals
    loc = [part for part in first.get("loc", ()) if not _is_union_tag(part)]
    param = field_path(loc) or None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value")


def _relevance(error: Any) -> tuple[bool, int]:
    depth = sum(1 for part in error.get("loc", ()) if not _is_union_tag(part))
    return not str(error.get("type", "")).endswith("_type"), depth


def field_path(loc: list[Any] | tuple[Any, ...]) -> str:
    """`("messages", 0, "content")` -> `messages[0].content`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried in the location (`str`, `list[...]`,
    # `function-after[...]`); those are not fields the client sent.
    return isinstance(part, str) and (
        "[" in part
        or part in {"str", "int", "float", "bool", "list", "dict", "none"}
        or part.startswith("constrained-")
    )
