"""The SSE stream of a Messages request (`stream: true`), in Anthropic's event sequence.

Every event is `event: <type>` then `data: <json>` whose `type` is the same name:

    message_start          the message, content empty, stop_reason null, usage so far
    content_block_start    a block opens: `text`, `thinking` (a reasoning model), or, with
                           tools, `tool_use` (`id`, `name`, `input: {}`)
    ping                   once, after the first block opens
    content_block_delta    `text_delta`, `thinking_delta` or (a tool_use block)
                           `input_json_delta` pieces, in order
    content_block_stop     each block closes before the next opens, the last one at the end
    message_delta          stop_reason, stop_sequence and the final usage (every count)
    message_stop

Blocks are written by `blocks.ContentWriter`, which also writes the whole answer, so a stream
and the same answer unstreamed have the same blocks. `message_start` is sent once the request is
admitted; a block opens with the first text it carries (no empty delta is sent ahead of the
first token, so clients measure a true time to first token). A generation that fails after the
stream began ends with an `error` event in Anthropic's error shape (`api_error`, or
`overloaded_error` when shutdown aborted it) and nothing after it. There is no `[DONE]`:
Anthropic's streams have none. The request is closed when the stream ends, is cancelled (the
client went away) or is dropped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from trio_mlx.http.anthropic.blocks import ContentWriter, event
from trio_mlx.http.anthropic.errors import anthropic_error
from trio_mlx.http.anthropic.messages import MessageRun
from trio_mlx.http.anthropic.objects import (
    Message,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    StopDelta,
)
from trio_mlx.http.generation import failure, outputs, sse_event
from trio_mlx.types import GenerationOutput


async def message_events(run: MessageRun) -> AsyncIterator[bytes]:
    """The stream's events, as bytes (see the module docstring)."""
    last: GenerationOutput | None = None
    blocks = ContentWriter()
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
            for chunk in blocks.feed(run.events(out)):
                yield chunk
            if not out.finished:
                continue
            error = failure(out)
            if error is not None:
                status = 503 if out.finish_reason == "abort" else 500
                body = anthropic_error(status, error["error"])
                yield sse_event("error", body)
                return
            for chunk in blocks.finish():
                yield chunk
            delta = StopDelta(
                stop_reason=run.stop_reason(out, blocks.calls), stop_sequence=out.stop_sequence
            )
            yield event(MessageDeltaEvent(delta=delta, usage=MessageUsage.of(out)))
            yield event(MessageStopEvent())
            return
    finally:
        run.active.close()
        run.record.finish(last)
