"""Errors in Anthropic's shape on the Messages routes: `{"type": "error", "error": {"type",
"message"}}`, with the status code the OpenAI routes give for the same failure.

Route code raises the server's `APIError` everywhere (validation, admission, a loading model);
the app's error handlers turn it into this shape for any path under `/v1/messages`
(`is_messages_path`), including what never reaches a route: malformed JSON, a body over the
limit (413), an unknown path or method. Anthropic's error object has no `param`: the offending
field leads the message instead, in Anthropic's dotted form (`messages.0.content.0.type: ...`).

Status to type: 400 (and other 4xx) `invalid_request_error`, 401 `authentication_error`, 403
`permission_error`, 404 `not_found_error`, 413 `request_too_large`, 503 (loading, draining, dead,
or a stream aborted by shutdown) `overloaded_error`, any other 5xx `api_error`. Admission's
refusal, a 429 on the OpenAI routes, is 529 `overloaded_error` here (`anthropic_status`), with its
`Retry-After`: Anthropic keeps 429 `rate_limit_error` for an account over its rate limits and
answers a busy service with 529, which its clients retry as such.

The body carries the request's `request_id` (`request_ids.py`, also the `request-id` header), and
for the refusals Anthropic's clients act on, `error.details.error_code`
(`DETAILED_CODES`: a request with a message `thread`, which this server does not hold, is
`thread_unsupported_request`, on which the SDK's tool runner resends the whole conversation).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from trio_mlx.http.anthropic.objects import (
    AnthropicError,
    AnthropicErrorObject,
    ErrorDetails,
    ErrorType,
)

MESSAGES_PATH = "/v1/messages"
#: The server's error codes that go to Anthropic's clients as `error.details.error_code`.
DETAILED_CODES = frozenset({"thread_unsupported_request"})

_TYPES: dict[int, ErrorType] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """Whether `path` is one of the Anthropic routes (their errors take this shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_status(status: int) -> int:
    """The status of an error of `status` on these routes: admission's 429 is Anthropic's 529
    (the service is overloaded), every other status is itself."""
    return 529 if status == 429 else status


def error_type(status: int) -> ErrorType:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def dotted(param: str) -> str:
    """`messages[0].content` -> `messages.0.content`, as Anthropic names fields."""
    return re.sub(r"\[(\d+)\]", r".\1", param).lstrip(".")


def anthropic_error(
    status: int, detail: Mapping[str, Any], request_id: str | None = None
) -> dict[str, Any]:
    """The Anthropic body for an error of `status` (`anthropic_status`'s) whose OpenAI-shape
    `detail` is `{"message", "type", "param", "code"}`; `request_id` when the request has one."""
    message = str(detail.get("message") or "error")
    param = detail.get("param")
    if param:
        name = dotted(str(param))
        if message.startswith(f"{param}:"):
            message = name + message[len(str(param)) :]
        elif not message.startswith(f"{name}:"):
            message = f"{name}: {message}"
    code = detail.get("code")
    details = ErrorDetails(error_code=code) if code in DETAILED_CODES else None
    error = AnthropicErrorObject(type=error_type(status), message=message, details=details)
    return AnthropicError(error=error, request_id=request_id).dump()
