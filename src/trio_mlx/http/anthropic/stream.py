"""The SSE stream of a Messages request (`stream: true`), in Anthropic's event sequence.

Every event is `event: <type>` then `data: <json>` whose `type` is the same name:

    message_start          the message, content empty, stop_reason null, usage so far
    content_block_start    index 0: a `text` block (or a `thinking` block first, for a
                           reasoning model, then the `text` block at index 1)
    ping                   once, after the first block opens
    content_block_delta    `text_delta` (or `thinking_delta`) pieces, in order
    content_block_stop     each block closes before the next opens, the last one at the end
    message_delta          stop_reason, stop_sequence and the final usage (every count)
    message_stop

`message_start` is sent once the request is admitted; a block opens with the first text it
carries (no empty delta is sent ahead of the first token, so clients measure a true time to first
token). A generation that fails after the stream began ends with an `error` event in Anthropic's
error shape (`api_error`, or `overloaded_error` when shutdown aborted it) and nothing after it.
There is no `[DONE]`: Anthropic's streams have none. The request is closed when the stream ends,
is cancelled (the client went away) or is dropped.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Literal

from trio_mlx.http.anthropic.errors import anthropic_error
from trio_mlx.http.anthropic.messages import MessageRun
from trio_mlx.http.anthropic.objects import (
    AnthropicObject,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    Message,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    PingEvent,
    StopDelta,
    TextBlock,
    ThinkingBlock,
)
from trio_mlx.http.generation import failure, outputs, sse_event
from trio_mlx.types import GenerationOutput

BlockKind = Literal["text", "thinking"]
_DELTA_TYPES = {"text": "text_delta", "thinking": "thinking_delta"}


def event(payload: AnthropicObject) -> bytes:
    """One SSE event named by the payload's `type`."""
    data = payload.dump()
    return sse_event(data["type"], data)


def delta_event(index: int, kind: BlockKind, text: str) -> bytes:
    """A `content_block_delta` event: the same bytes as `event(ContentBlockDeltaEvent(...))`,
    written directly (one `json.dumps` of the text a token, not a model's validation and dump)."""
    return (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
        + str(index).encode()
        + b',"delta":{"type":"'
        + _DELTA_TYPES[kind].encode()
        + b'","'
        + kind.encode()
        + b'":'
        + json.dumps(text).encode()
        + b"}}\n\n"
    )


class _Blocks:
    """The content blocks opened so far: which one is open, and the events to switch blocks."""

    def __init__(self) -> None:
        self.count = 0
        self.open: BlockKind | None = None
        self.has_text = False

    def add(self, kind: BlockKind, text: str) -> list[bytes]:
        """The events that append `text` to a block of `kind` (opening it if needed)."""
        out = []
        if self.open != kind:
            out.extend(self.start(kind))
        out.append(delta_event(self.count - 1, kind, text))
        return out

    def start(self, kind: BlockKind) -> list[bytes]:
        out = self.stop()
        block = TextBlock(text="") if kind == "text" else ThinkingBlock(thinking="")
        out.append(event(ContentBlockStartEvent(index=self.count, content_block=block)))
        if self.count == 0:
            out.append(event(PingEvent()))
        self.count += 1
        self.open = kind
        self.has_text = self.has_text or kind == "text"
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event(ContentBlockStopEvent(index=self.count - 1))]


async def message_events(run: MessageRun) -> AsyncIterator[bytes]:
    """The stream's events, as bytes (see the module docstring)."""
    last: GenerationOutput | None = None
    blocks = _Blocks()
    try:
        start = Message(
            id=run.id,
            model=run.model,
            content=[],
            usage=MessageUsage(input_tokens=run.prompt_tokens, output_tokens=0),
        )
        yield event(MessageStartEvent(message=start))
        async for out in outputs(run.active):
            last = out
            if out.new_reasoning:
                for chunk in blocks.add("thinking", out.new_reasoning):
                    yield chunk
            if out.new_text:
                for chunk in blocks.add("text", out.new_text):
                    yield chunk
            if not out.finished:
                continue
            error = failure(out)
            if error is not None:
                status = 503 if out.finish_reason == "abort" else 500
                body = anthropic_error(status, error["error"])
                yield sse_event("error", body)
                return
            closing = blocks.start("text") if not blocks.has_text else []
            for chunk in [*closing, *blocks.stop()]:
                yield chunk
            delta = StopDelta(stop_reason=run.stop_reason(out), stop_sequence=out.stop_sequence)
            yield event(MessageDeltaEvent(delta=delta, usage=MessageUsage.of(out)))
            yield event(MessageStopEvent())
            return
    finally:
        run.active.close()
        run.record.finish(last)
