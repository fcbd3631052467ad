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
from trio_mlx.http.generation import failure, joined, sse_event
from trio_mlx.types import GenerationOutput


async def message_events(run: MessageRun) -> AsyncIterator[bytes]:
    """The stream's events, as bytes (see the module docstring). The events of one output go
    out as one body chunk: one write, the same events."""
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
        async for out in run.active.stream:
            last = out
            if out.finished:
                run.active.close()  # the slot is free before the last events are written
            ready = blocks.feed(run.events(out))
            if out.finished:
                ready += _final_events(run, blocks, out)
            if ready:
                yield joined(ready)
            if out.finished:
                return
    finally:
        run.active.close()
        run.record.finish(last)


def _final_events(run: MessageRun, blocks: ContentWriter, out: GenerationOutput) -> list[bytes]:
    """After the last output's content: the last block's stop, `message_delta` and
    `message_stop`; or, when generation failed, an `error` event and nothing after it."""
    error = failure(out)
    if error is not None:
        status = 503 if out.finish_reason == "abort" else 500
        return [sse_event("error", anthropic_error(status, error["error"]))]
    delta = StopDelta(
        stop_reason=run.stop_reason(out, blocks.calls), stop_sequence=out.stop_sequence
    )
    return [
        *blocks.finish(),
        event(MessageDeltaEvent(delta=delta, usage=MessageUsage.of(out))),
        event(MessageStopEvent()),
    ]
