"""The API key (`trio-mlx serve --api-key KEY`): an ASGI middleware that refuses, with 401, every
request that does not carry the key, but for the routes that stay open.

A request carries the key as OpenAI clients send it (`Authorization: Bearer KEY`) or as Anthropic
clients do (`x-api-key: KEY`); either header with the right key is enough. The comparison is
`hmac.compare_digest` of SHA-256 digests, whose time depends neither on how much of the key a
guess got right nor on the key's length.

Open without the key: `GET /health` (load balancers and supervisors probe it) and the chat page's
files (`/` and `/page/...`, see `http/page.py`): the page has to load before it can ask its user
for the key. Everything else needs it, unknown paths included (a 401 rather than a 404, so that
the routes are not probed without the key), and so does the WebSocket of `/v1/responses`: a
session without the key is refused before it is accepted, with the same 401 response (ASGI's
WebSocket denial response), or closed with code 1008 where the server cannot send one.

A refusal is the OpenAI error body (`invalid_request_error`, code `invalid_api_key`, as OpenAI
answers a bad key) with `WWW-Authenticate: Bearer`; under `/v1/messages` (the Anthropic routes)
it is Anthropic's (`{"type": "error", "error": {"type": "authentication_error", ...}}`), the
shape those clients read. The request's body is read (up to `max_body_bytes`) and dropped before
the answer, so that the connection can serve the client's next request, the retry with the key.

It sits inside the access log, so a refused request is logged with its 401.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import trio

from trio_mlx.http.errors import INVALID_REQUEST, error_body

#: Paths answered without the key (the chat page's files are matched by prefix too).
OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/page/",)
#: Routes whose clients read Anthropic's error shape.
ANTHROPIC_PREFIX = "/v1/messages"
#: How long a refused request's body may take to arrive before the answer goes out anyway.
BODY_DRAIN_SECONDS = 10.0


def is_open(path: str) -> bool:
    """True for the paths that need no key (`/health`, the chat page)."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request presents: the token of `Authorization: Bearer ...` and `x-api-key`."""
    keys: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                keys.append(token.strip())
        elif lowered == b"x-api-key" and value.strip():
            keys.append(value.strip())
    return keys


def refusal_body(path: str, presented: bool) -> dict[str, Any]:
    """The 401 body for a request to `path` that presented a wrong key (or none)."""
    message = (
        "Incorrect API key provided."
        if presented
        else "This server needs an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
    )
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return {"type": "error", "error": {"type": "authentication_error", "message": message}}
    return error_body(message, type=INVALID_REQUEST, code="invalid_api_key")


class RequireAPIKey:
    """Wraps an ASGI app; passes a request on only if it carries `key` or its path is open."""

    def __init__(self, app: Any, key: str, *, max_body_bytes: int) -> None:
        if not key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()
        self._max_body_bytes = max_body_bytes

    def allows(self, scope: dict[str, Any]) -> bool:
        """True when the request may go on: an open path, or one of its keys is the key."""
        if scope["type"] == "http" and is_open(scope.get("path", "")):
            return True
        # Every presented key is compared (no early exit), each in constant time.
        matches = [
            hmac.compare_digest(hashlib.sha256(k).digest(), self._digest)
            for k in presented_keys(scope["headers"])
        ]
        return any(matches)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
            return
        presented = bool(presented_keys(scope["headers"]))
        body = json.dumps(refusal_body(scope.get("path", ""), presented)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        if scope["type"] == "http":
            if not await self._drain_body(receive):
                headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})

    async def _drain_body(self, receive: Any) -> bool:
        """Read the request's body to its end and drop it; False if it was too large or too slow
        (the connection is closed after the answer then)."""
        read = 0
        with trio.move_on_after(BODY_DRAIN_SECONDS):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return False  # the client went away
                read += len(message.get("body", b""))
                if read > self._max_body_bytes:
                    return False
                if not message.get("more_body", False):
                    return True
        return False
