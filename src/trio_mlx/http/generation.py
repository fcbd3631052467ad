"""What every generation route shares: preparing and admitting a request with HTTP errors, the
SSE framing, the error a stream ends with, and logprobs in the OpenAI shapes.

A request is decided before the first byte: validation and admission (`start`; a preparation
alone: `prepare_async`) raise `APIError`, so a refused request gets its status code, never
an HTTP 200 with an empty stream. Once admitted, the `ActiveRequest` is owned by the HTTP
request's ASGI call (`ownership.own`): it is closed when that call ends, whatever the point of the
response's life at which it ended (a client gone before the body's first byte included).
`outputs` and `run_to_end` close it earlier, as soon as iteration ends, is cancelled or the
iterator is dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from trio_mlx.actors.request import ActiveRequest, GenerationStream
from trio_mlx.errors import TrioMLXError
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.errors import (
    SERVER_ERROR,
    UNAVAILABLE,
    APIError,
    error_body,
    from_engine_error,
)
from trio_mlx.http.objects import (
    ChoiceLogprobs,
    CompletionLogprobs,
    TokenLogprobOut,
    TopLogprob,
)
from trio_mlx.http.ownership import own
from trio_mlx.types import GenerationOutput, TokenLogprob

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def prepare(build: Callable[[], T]) -> T:
    """Run the engine's synchronous request preparation, turning its refusals into 400s.
    It tokenizes on the event loop: routes use `prepare_async`."""
    try:
        return build()
    except TrioMLXError as exc:
        raise from_engine_error(exc) from exc


async def prepare_async(build: Callable[[], Awaitable[T]]) -> T:
    """Await the engine's request preparation (`Engine.prepare_chat_async` /
    `prepare_generate_async`: tokenization off the event loop), refusals as 400s."""
    try:
        return await build()
    except TrioMLXError as exc:
        raise from_engine_error(exc) from exc


async def start(begin: Callable[[], Awaitable[ActiveRequest]]) -> ActiveRequest:
    """Preparation and admission in one (`Engine.start_chat` / `start_generate`: admission in
    arrival order); refusals become 400, 429 (with Retry-After) or 503. The admitted request is
    owned by the current HTTP request (see `ownership`)."""
    try:
        return own(await begin())
    except TrioMLXError as exc:
        raise from_engine_error(exc) from exc


def outputs(active: ActiveRequest) -> GenerationStream:
    """The request's outputs; closing, cancelling or dropping the iterator aborts the request."""

    async def started() -> ActiveRequest:
        return active

    return GenerationStream(started)


def json_bytes(value: Any) -> bytes:
    """`value` as compact JSON (no spaces), encoded: how every SSE payload is written."""
    return json.dumps(value, separators=(",", ":")).encode()


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE `data:` event."""
    return b"data: " + json_bytes(payload) + b"\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """One SSE event with an `event:` line (the Responses API's framing)."""
    data = json.dumps(payload, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n".encode()


def openai_finish_reason(final: GenerationOutput) -> Literal["stop", "length"]:
    """A successful request's `finish_reason` as OpenAI names it (EOS and stop strings: stop)."""
    return "length" if final.finish_reason == "length" else "stop"


def failure(final: GenerationOutput) -> dict[str, Any] | None:
    """The error body a stream ends with when its request failed or was aborted, else None."""
    if final.finish_reason == "error":
        return error_body(
            f"generation failed: {final.error or 'unknown error'}",
            type=SERVER_ERROR,
            code="generation_error",
        )
    if final.finish_reason == "abort":
        return error_body(
            "the request was aborted: the server is shutting down",
            type=UNAVAILABLE,
            code="aborted",
        )
    return None


class TokenText:
    """Token ids as the strings and bytes the logprobs shapes report (cached per token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = str(self._tokenizer.decode([token]))
            self._cache[token] = text
        return text

    def bytes(self, token: int) -> list[int]:
        return list(self(token).encode("utf-8"))

    def chat_logprobs(self, items: Sequence[TokenLogprob] | None) -> ChoiceLogprobs | None:
        """Chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
        if items is None:
            return None
        return ChoiceLogprobs(
            content=[
                TokenLogprobOut(
                    token=self(item.token),
                    logprob=item.logprob,
                    bytes=self.bytes(item.token),
                    top_logprobs=[
                        TopLogprob(token=self(t), logprob=lp, bytes=self.bytes(t))
                        for t, lp in item.top
                    ],
                )
                for item in items
            ]
        )

    def completion_logprobs(
        self, items: Sequence[TokenLogprob] | None, offset: int
    ) -> CompletionLogprobs | None:
        """Completions' `{tokens, token_logprobs, top_logprobs, text_offset}`; `offset` is where
        the first token's text starts in the choice's text."""
        if items is None:
            return None
        out = CompletionLogprobs()
        for item in items:
            text = self(item.token)
            out.tokens.append(text)
            out.token_logprobs.append(item.logprob)
            out.top_logprobs.append({self(t): lp for t, lp in item.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out


async def run_to_end(active: ActiveRequest, record: RequestRecord) -> GenerationOutput:
    """Run an admitted request to its final output. However that ends (done, failed, cancelled
    because the client went away) the request is closed and its outcome noted in `record`."""
    last: GenerationOutput | None = None
    try:
        async for output in outputs(active):
            last = output
    finally:
        active.close()
        record.finish(last)
    assert last is not None and last.finished
    return last


def raise_failure(final: GenerationOutput) -> None:
    """For a non-streaming answer: a failed (500) or aborted (503) request as an `APIError`."""
    error = failure(final)
    if error is not None:
        detail = error["error"]
        status = 503 if final.finish_reason == "abort" else 500
        raise APIError(status, detail["message"], type=detail["type"], code=detail["code"])
