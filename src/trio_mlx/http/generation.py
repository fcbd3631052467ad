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
from json.encoder import encode_basestring_ascii
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


#: the objects whose ids OpenAI writes with a dash (`chatcmpl-…`, `cmpl-…`)
_DASHED = frozenset({"chatcmpl", "cmpl"})


def new_id(prefix: str) -> str:
    """A new object id spelled as OpenAI spells that object's: a dash after the Chat
    Completions and Completions prefixes, an underscore after the Responses and Conversations
    ones (`resp_…`, `msg_…`, `fc_…`, `rs_…`, `conv_…`)."""
    separator = "-" if prefix in _DASHED else "_"
    return f"{prefix}{separator}{uuid.uuid4().hex[:24]}"


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


#: `json.dumps(value, separators=(",", ":"))` without building an encoder per call.
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def json_text(value: Any) -> str:
    """`value` as compact JSON (no spaces): `json.dumps(value, separators=(",", ":"))`."""
    return _COMPACT.encode(value)


def json_bytes(value: Any) -> bytes:
    """`value` as compact JSON (no spaces), encoded: how every SSE payload is written."""
    return _COMPACT.encode(value).encode()


def json_string(text: str) -> bytes:
    """`text` as a JSON string literal: the bytes `json_bytes(text)` gives (ASCII, escaped), for
    templates that write a token's event around the one string it carries."""
    return encode_basestring_ascii(text).encode()


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE `data:` event."""
    return b"data: " + json_bytes(payload) + b"\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """One SSE event with an `event:` line (the Responses API's framing)."""
    return sse_frame(event, _COMPACT.encode(payload))


def sse_frame(event: str, data: str) -> bytes:
    """One SSE event with an `event:` line, its `data:` already JSON text."""
    return f"event: {event}\ndata: {data}\n\n".encode()


def joined(events: list[bytes]) -> bytes:
    """The SSE events that are ready together, as one body chunk: one write to the socket
    (hypercorn's send path costs about as much for one event as for several), the same events."""
    return events[0] if len(events) == 1 else b"".join(events)


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
    """Token ids as the strings and bytes the logprobs shapes report (cached per token).

    `bytes` are the token's own bytes, as OpenAI's logprobs give them so that a client can join
    the pieces of a character split across tokens: read from the vocabulary where the tokenizer
    says how (byte-level BPE: each symbol one byte; SentencePiece: `<0xNN>` byte tokens, `▁` a
    space), else the UTF-8 of the token decoded alone (which turns a partial character into
    U+FFFD)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._pieces = _token_pieces(tokenizer)

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = str(self._tokenizer.decode([token]))
            self._cache[token] = text
        return text

    def bytes(self, token: int) -> list[int]:
        raw = self._bytes.get(token)
        if raw is None:
            raw = self._pieces(token) if self._pieces is not None else None
            if raw is None:
                raw = list(self(token).encode("utf-8"))
            self._bytes[token] = raw
        return raw

    def chat_logprobs(self, items: Sequence[TokenLogprob] | None) -> ChoiceLogprobs | None:
        """Chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
        if items is None:
            return None
        return ChoiceLogprobs(content=self.token_logprobs(items))

    def token_logprobs(self, items: Sequence[TokenLogprob]) -> list[TokenLogprobOut]:
        """Each token as `{token, logprob, bytes, top_logprobs}` (chat's `logprobs.content`, a
        Responses `output_text`'s `logprobs`)."""
        return [
            TokenLogprobOut(
                token=self(item.token),
                logprob=item.logprob,
                bytes=self.bytes(item.token),
                top_logprobs=[
                    TopLogprob(token=self(t), logprob=lp, bytes=self.bytes(t)) for t, lp in item.top
                ],
            )
            for item in items
        ]

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


async def run_to_end(
    active: ActiveRequest,
    record: RequestRecord,
    each: Callable[[GenerationOutput], object] | None = None,
) -> GenerationOutput:
    """Run an admitted request to its final output (`each`, if given, is called with every
    output). However that ends (done, failed, cancelled because the client went away) the
    request is closed and its outcome noted in `record`."""
    last: GenerationOutput | None = None
    try:
        async for output in outputs(active):
            last = output
            if each is not None:
                each(output)
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


def _token_pieces(tokenizer: Any) -> Any:
    """A function from a token id to its raw bytes (None where the vocabulary does not say),
    for the vocabularies whose pieces spell bytes (mlx-lm's detokenizer tells which), else None."""
    from mlx_lm import tokenizer_utils

    detokenizer = type(getattr(tokenizer, "detokenizer", None))
    to_piece = getattr(tokenizer, "convert_ids_to_tokens", None)
    if to_piece is None:
        return None
    if detokenizer is tokenizer_utils.BPEStreamingDetokenizer:
        byte_of = {symbol: byte for byte, symbol in _byte_symbols().items()}

        def byte_level(token: int) -> list[int] | None:
            piece = to_piece(token)
            if not isinstance(piece, str):
                return None
            try:
                return [byte_of[c] for c in piece]
            except KeyError:  # an added token spelled in plain text
                return None

        return byte_level
    if detokenizer is tokenizer_utils.SPMStreamingDetokenizer:

        def sentencepiece(token: int) -> list[int] | None:
            piece = to_piece(token)
            if not isinstance(piece, str):
                return None
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return [int(piece[3:5], 16)]
                except ValueError:
                    return None
            return list(piece.replace("\u2581", " ").encode("utf-8"))

        return sentencepiece
    return None


def _byte_symbols() -> dict[int, str]:
    """Byte-level BPE's alphabet: every byte as the printable character that stands for it in
    the vocabulary (printable Latin-1 bytes as themselves, the rest from U+0100 on)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(0x100 + extra)
            extra += 1
    return symbols
