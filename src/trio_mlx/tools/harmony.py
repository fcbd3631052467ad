"""gpt-oss (OpenAI's harmony format): the reply is a sequence of messages, each a header, then
`<|message|>`, its body and an end (`<|end|>`, `<|call|>` or `<|return|>`). The `analysis` channel
is reasoning, the `final` channel (and `commentary` without a recipient) is content, and a
message addressed `to=functions.NAME` is a call whose body is its JSON arguments:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city":"Paris"}<|call|>

(wrapped here; the model writes no newlines between the markers).

A reply with no harmony markup is content as it is."""

from __future__ import annotations

import re
from typing import Literal

from trio_mlx.tools.calls import new_call_id
from trio_mlx.tools.events import ArgumentsAppended, CallStarted, Content, Reasoning, ToolEvent
from trio_mlx.tools.format import ToolCallStream, ToolFormat
from trio_mlx.tools.markup import cut_at_first, partial_marker_suffix, stable_prefix

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
START = "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_FUNCTIONS = "functions."


class HarmonyFormat(ToolFormat):
    name = "harmony"

    def stream(self) -> HarmonyStream:
        return HarmonyStream()


class HarmonyStream(ToolCallStream):
    def __init__(self) -> None:
        self._mode: Literal["start", "header", "body", "plain"] = "start"
        self._buffer = ""
        self._kind: Literal["content", "reasoning", "call"] = "content"
        self._calls = 0
        self._sent = ""  # the open call's arguments sent so far

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        self._buffer += text
        while self._buffer:
            if self._mode == "plain":
                events.append(Content(self._buffer))
                self._buffer = ""
            elif self._mode == "start":
                head = self._buffer.lstrip()
                if head.startswith((CHANNEL, START)):
                    self._mode, self._buffer = "header", head
                elif any(m.startswith(head) for m in (CHANNEL, START)):
                    break
                else:
                    self._mode = "plain"
            elif self._mode == "header":
                index = self._buffer.find(MESSAGE)
                if index < 0:
                    break
                self._open(events, self._buffer[:index])
                self._buffer = self._buffer[index + len(MESSAGE) :]
                self._mode = "body"
            else:
                found = cut_at_first(self._buffer, ENDS)
                if found is None:
                    self._body(events, final=False)
                    break
                index, marker = found
                rest = self._buffer[index + len(marker) :]
                self._buffer = self._buffer[:index]
                self._body(events, final=True)
                self._buffer, self._mode = rest, "header"
        return events

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._mode == "body":
            self._body(events, final=True)
        elif self._buffer and (
            self._mode in ("start", "plain") or "<|" not in self._buffer
        ):  # text that never became a header (in "header" mode: one without markup) is content
            events.append(Content(self._buffer))
        self._buffer = ""
        return events

    def _open(self, events: list[ToolEvent], header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith(_FUNCTIONS):
            self._kind = "call"
            self._sent = ""
            name = recipient.group(1)[len(_FUNCTIONS) :]
            events.append(CallStarted(self._calls, new_call_id(), name))
        elif channel and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _body(self, events: list[ToolEvent], *, final: bool) -> None:
        if self._kind == "call":
            settled = self._buffer.strip() if final else stable_prefix(self._buffer, ENDS).lstrip()
            if final and not settled:
                settled = "{}"
            if len(settled) > len(self._sent) and settled.startswith(self._sent):
                events.append(ArgumentsAppended(self._calls, settled[len(self._sent) :]))
                self._sent = settled
            if final:
                self._calls += 1
                self._buffer = ""
            return
        keep = 0 if final else partial_marker_suffix(self._buffer, ENDS)
        text = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        if text:
            events.append(Reasoning(text) if self._kind == "reasoning" else Content(text))
