"""A `request-id` on every answer an Anthropic client gets, as Anthropic's API sends one.

Anthropic's clients read the `request-id` header: the SDK's `message._request_id`, and the text
of every error it raises (`... (request_id: req_..., ...)`), which is what a user quotes when
reporting a failure. `RequestIds` gives each request to the Anthropic routes (`/v1/messages...`),
or any request that says it speaks Anthropic's API (an `anthropic-version` header, which the
official clients send on every call, `GET /v1/models` included), a fresh `req_...` id: in the
header of its answer, whatever answers it (a route, an error handler, the API key's 401), and in
the ASGI scope (`request_id_of`), for the `request_id` of an error body. Other requests are
passed on untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any

from trio_mlx.http.anthropic.errors import is_messages_path

#: The ASGI scope key of the request's id.
REQUEST_ID_KEY = "trio_mlx.anthropic.request_id"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def speaks_anthropic(scope: Any) -> bool:
    """Whether the request is to an Anthropic route or carries `anthropic-version`."""
    if is_messages_path(scope.get("path", "")):
        return True
    return any(name.lower() == b"anthropic-version" for name, _ in scope.get("headers", ()))


def request_id_of(scope: Any) -> str | None:
    """The request's id, if `RequestIds` gave it one."""
    value = scope.get(REQUEST_ID_KEY)
    return value if isinstance(value, str) else None


class RequestIds:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not speaks_anthropic(scope):
            await self.app(scope, receive, send)
            return
        request_id = scope[REQUEST_ID_KEY] = new_request_id()
        header = (b"request-id", request_id.encode())

        def send_with_id(message: dict[str, Any]) -> Awaitable[None]:
            # Not a coroutine of its own: a streamed body's chunks go straight to `send`.
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            return send(message)  # type: ignore[no-any-return]

        await self.app(scope, receive, send_with_id)
