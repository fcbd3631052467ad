"""An answer's content blocks, written from what the model says, in the order it says it.

`ContentWriter` takes the answer's pieces as tool events (`Reasoning`, `Content`, `CallStarted`,
`ArgumentsAppended`: from the tool-call reader, or the text itself when nothing is parsed) and
gives both the stream's events for them and the final content blocks, so that a streamed answer
and the same answer whole are one thing:

- consecutive pieces of one kind go to one block (`thinking`, `text`); a block opens with its
  first piece (`content_block_start`, then `ping` after the first block) and closes
  (`content_block_stop`) when the next block opens or the answer ends;
- a call opens a `tool_use` block (`id`: a fresh `toolu_...`, whatever id the model's format
  gave it; `name`; `input: {}`), its argument pieces are
  `input_json_delta` events whose `partial_json`, joined, is the block's `input` as JSON text;
- an answer with neither text nor calls ends with one empty `text` block.

A call cut short (the answer ran out of `max_tokens`, or met a stop sequence, inside its
arguments) keeps its block, as Anthropic's answers do: its `input` holds the arguments' keys
whose values were written whole, what the official clients' stream accumulators make of the
same `partial_json`. A call whose arguments are not a JSON object (a model's malformed call) has
`input` `{}`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic_core import from_json

from trio_mlx.http.anthropic.objects import (
    AnthropicObject,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    OutputBlock,
    PingEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from trio_mlx.http.generation import json_string, sse_event
from trio_mlx.tools import (
    ArgumentsAppended,
    CallStarted,
    Content,
    Reasoning,
    ToolEvent,
    new_call_id,
)

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
        + json_string(text)
        + b"}}\n\n"
    )


class _Block:
    """A block being written: its kind, pieces, and (a call) id and name."""

    def __init__(self, kind: str, call: CallStarted | None = None) -> None:
        self.kind = kind
        self.call = call
        self.pieces: list[str] = []

    def output(self) -> OutputBlock:
        text = "".join(self.pieces)
        if self.call is not None:
            return ToolUseBlock(id=self.call.id, name=self.call.name, input=_input(text))
        if self.kind == "thinking":
            return ThinkingBlock(thinking=text)
        return TextBlock(text=text)


def _input(arguments: str) -> dict[str, Any]:
    """A call's `input`: its arguments' JSON object, or, cut short, what of it is whole (the
    keys whose values are complete), as the official clients read a stream's `partial_json`."""
    try:
        value = from_json(arguments or "{}", allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentWriter:
    """The blocks of one answer (see the module docstring)."""

    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._open: int | None = None
        #: a call's index (in the reader's events) -> its block's index
        self._calls: dict[int, int] = {}

    @property
    def calls(self) -> int:
        return len(self._calls)

    def feed(self, events: Iterable[ToolEvent]) -> list[bytes]:
        """The stream events that write `events` into the answer."""
        out: list[bytes] = []
        for item in events:
            if isinstance(item, Content | Reasoning):
                if item.text:
                    out += self._append("text" if isinstance(item, Content) else "thinking", item)
            elif isinstance(item, CallStarted):
                call = CallStarted(item.index, new_call_id("toolu_"), item.name)
                out += self._start(_Block("tool_use", call))
                self._calls[item.index] = len(self._blocks) - 1
            else:
                out += self._arguments(item)
        return out

    def finish(self) -> list[bytes]:
        """The events that end the answer: an empty text block if it has neither text nor
        calls, and the last block's stop."""
        out: list[bytes] = []
        if not any(block.kind in ("text", "tool_use") for block in self._blocks):
            out += self._start(_Block("text"))
        return out + self._stop()

    def content(self) -> list[OutputBlock]:
        return [block.output() for block in self._blocks]

    def _append(self, kind: BlockKind, item: Content | Reasoning) -> list[bytes]:
        out: list[bytes] = []
        if self._open is None or self._blocks[self._open].kind != kind:
            out += self._start(_Block(kind))
        assert self._open is not None
        self._blocks[self._open].pieces.append(item.text)
        out.append(delta_event(self._open, kind, item.text))
        return out

    def _arguments(self, item: ArgumentsAppended) -> list[bytes]:
        index = self._calls.get(item.index)
        if index is None or not item.text:
            return []
        self._blocks[index].pieces.append(item.text)
        delta = InputJsonDelta(partial_json=item.text)
        return [event(ContentBlockDeltaEvent(index=index, delta=delta))]

    def _start(self, block: _Block) -> list[bytes]:
        out = self._stop()
        index = len(self._blocks)
        self._blocks.append(block)
        start: OutputBlock
        if block.call is not None:
            start = ToolUseBlock(id=block.call.id, name=block.call.name, input={})
        elif block.kind == "thinking":
            start = ThinkingBlock(thinking="")
        else:
            start = TextBlock(text="")
        out.append(event(ContentBlockStartEvent(index=index, content_block=start)))
        if index == 0:
            out.append(event(PingEvent()))
        self._open = index
        return out

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [event(ContentBlockStopEvent(index=index))]
