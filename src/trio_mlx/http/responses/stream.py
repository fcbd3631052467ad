"""The event sequence of a streamed Responses reply: the SSE stream and the WebSocket mode.

`response.created`, `response.in_progress`, then each output item: a message
(`response.output_item.added`, `response.content_part.added`, one `response.output_text.delta`
per piece of text, `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`) or a function call (`response.output_item.added` with the
`function_call` item, `response.function_call_arguments.delta` per piece of its arguments,
`response.function_call_arguments.done`, `response.output_item.done`) or the model's reasoning
(a model whose tokenizer has thinking tags: `response.output_item.added` with the `reasoning`
item, `response.content_part.added` with its `reasoning_text` part, one
`response.reasoning_text.delta` per piece, `response.reasoning_text.done`,
`response.content_part.done`, `response.output_item.done`); then `response.completed` (or
`response.incomplete` when `max_output_tokens` ran out, `response.failed` when generation
failed). Without tools or reasoning the reply is one message, opened before the first token;
otherwise an item is opened by its first piece and closes the item before it, and a reply
without tools ends with a message (empty if it wrote no text).

The events come in batches, the events ready together (those before the first token, then each
output's), so that a transport writes each batch at once: the SSE route frames them with
`event:` lines (no `[DONE]`: the Responses API has none), the WebSocket sends each as one
message. The request is closed when the sequence ends, is cancelled (the client went away) or is
dropped; a response is kept (`store`) when it ends, before its last event, and one whose
sequence was cut short (the client went away) is not kept.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from json.encoder import encode_basestring_ascii
from typing import Any

from trio_mlx.http.generation import json_text, new_id
from trio_mlx.http.objects import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseStreamEvent,
    TextLogprob,
    TokenLogprobOut,
)
from trio_mlx.http.responses.run import ResponseRun, reply_events, response_status
from trio_mlx.tools import ArgumentsAppended, CallStarted, Content, Reasoning
from trio_mlx.types import GenerationOutput

#: One event of the stream as it is sent: its type and its JSON text (the SSE `event:` and
#: `data:`, or one WebSocket message).
ResponseEvent = tuple[str, str]
_TEXT_DELTA = "response.output_text.delta"


def response_events(run: ResponseRun) -> AsyncGenerator[list[ResponseEvent]]:
    """The events of an admitted response, in batches (see the module docstring)."""
    return ResponseEvents(run).events()


class ResponseEvents:
    """Writes one response's events: numbers them, and keeps the output items written so far
    and the one being written, which the last event's response carries."""

    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.calls = run.calls
        self._reasons = run.reasons
        self._logprobs = run.logprobs
        self._sequence = 0
        #: Output items finished so far, and the one being written.
        self._items: list[OutputItem] = []
        self._message: OutputMessage | None = None
        self._call: FunctionCallItem | None = None
        self._reasoning: ReasoningItem | None = None
        #: The stream's tokens, as they write its text, reasoning and calls.
        self._tokens = run.reply_tokens()
        #: The response as its last event carries it, once it has ended.
        self.final: ResponseObject | None = None

    def partial(self, status: str) -> ResponseObject:
        """The response at `status` with the output written so far (a background response
        retrieved while it runs, or cancelled)."""
        output = [*self._items, *self._open_items()]
        return self.run.response(status, output, None, self._tokens.reasoning)

    async def events(self) -> AsyncGenerator[list[ResponseEvent]]:
        """The event sequence of a streamed response, in batches: the events that are ready
        together (those before the first token; then each output's), to be written at once."""
        last: GenerationOutput | None = None
        try:
            ready = [
                self._event("response.created", response=self.run.response("in_progress")),
                self._event("response.in_progress", response=self.run.response("in_progress")),
            ]
            if self.calls is None and not self._reasons:  # one message, before the first token
                ready += self._open_message()
            yield ready
            async for out in self.run.active.stream:
                last = out
                self._tokens.note(out.new_tokens)
                status = response_status(out) if out.finished else None
                if status is None:
                    ready = self._reply_events(out)
                    if ready:
                        yield ready
                    continue
                self.run.close()  # the slot is free before the last events are written
                ready = []
                if status != "failed":
                    ready += self._reply_events(out)
                    ready += self._end_events(out, status)
                output = [*self._items, *self._open_items()]
                response = self.run.response(status, output, out, self._tokens.reasoning)
                self.run.end(response)  # kept before the client can read that it ended
                self.final = response
                ready.append(self._event(f"response.{status}", response=response))
                yield ready
                return
        finally:
            self.run.close()
            self.run.record.finish(last)

    def _open_items(self) -> list[OutputItem]:
        return [item for item in (self._reasoning, self._message, self._call) if item is not None]

    def _end_events(self, out: GenerationOutput, status: str) -> list[ResponseEvent]:
        """The events that end a reply that did not fail: the last item's close (a reply
        without tools that wrote no text gets its empty message first)."""
        events: list[ResponseEvent] = []
        wrote_text = self._message is not None or any(
            isinstance(item, OutputMessage) for item in self._items
        )
        if self.calls is None and not wrote_text:
            events += self._close_item("completed") + self._open_message()
        rest = self._tokens.end()  # tokens that wrote no text of their own
        if self._message is not None:
            self._add_logprobs(out, rest)
        item_status = "incomplete" if status == "incomplete" else "completed"
        if self._call is not None and self._cut_call():
            item_status = "incomplete"
        return events + self._close_item(item_status)

    def _cut_call(self) -> bool:
        """Whether the call being written is one the reader does not count whole (a forced
        call's JSON that a stop string cut)."""
        started = 1 + sum(isinstance(item, FunctionCallItem) for item in self._items)
        return self.calls is not None and self.calls.calls < started

    def _reply_events(self, out: GenerationOutput) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        for event in reply_events(out, self.calls):
            tokens = self._tokens.read(event)
            if isinstance(event, Reasoning):
                if self._reasoning is None:
                    events += self._close_item("completed") + self._open_reasoning()
                assert self._reasoning is not None
                self._reasoning.content[0].text += event.text
                events.append(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=self._reasoning.id,
                        output_index=len(self._items),
                        content_index=0,
                        delta=event.text,
                    )
                )
            elif isinstance(event, Content):
                if self._message is None:
                    events += self._close_item("completed") + self._open_message()
                assert self._message is not None
                self._message.content[0].text += event.text
                logprobs = self._add_logprobs(out, tokens)
                if logprobs:
                    events.append(
                        self._event(
                            _TEXT_DELTA,
                            item_id=self._message.id,
                            output_index=len(self._items),
                            content_index=0,
                            delta=event.text,
                            logprobs=[TextLogprob.of(item) for item in logprobs],
                        )
                    )
                else:
                    events.append(self._text_delta(self._message.id, len(self._items), event.text))
            elif isinstance(event, CallStarted):
                events += self._close_item("completed")
                self._call = FunctionCallItem(
                    id=new_id("fc"),
                    call_id=event.id,
                    name=event.name,
                    arguments="",
                    status="in_progress",
                )
                events.append(
                    self._event(
                        "response.output_item.added",
                        output_index=len(self._items),
                        item=self._call.model_copy(),
                    )
                )
            elif isinstance(event, ArgumentsAppended) and self._call is not None:
                self._call.arguments += event.text
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._call.id,
                        output_index=len(self._items),
                        delta=event.text,
                    )
                )
        return events

    def _add_logprobs(self, out: GenerationOutput, tokens: list[int]) -> list[TokenLogprobOut]:
        """Add the tokens at `tokens` to the open message's text logprobs; they, in the part's
        shape (none when the logprobs are not included)."""
        if self._message is None or not self._logprobs or not tokens:
            return []
        items = self.run.text_logprobs(out, tokens)
        part = self._message.content[0]
        part.logprobs = [*(part.logprobs or ()), *items]
        return items

    def _open_message(self) -> list[ResponseEvent]:
        self._message = OutputMessage(
            id=new_id("msg"), status="in_progress", content=[self._empty_text()]
        )
        where: dict[str, Any] = {"item_id": self._message.id, "output_index": len(self._items)}
        empty = OutputMessage(id=self._message.id, status="in_progress", content=[])
        return [
            self._event("response.output_item.added", output_index=len(self._items), item=empty),
            self._event(
                "response.content_part.added", **where, content_index=0, part=self._empty_text()
            ),
        ]

    def _empty_text(self) -> OutputText:
        return OutputText(text="", logprobs=[] if self._logprobs else None)

    def _open_reasoning(self) -> list[ResponseEvent]:
        self._reasoning = ReasoningItem(
            id=new_id("rs"), status="in_progress", content=[ReasoningText(text="")]
        )
        where: dict[str, Any] = {"item_id": self._reasoning.id, "output_index": len(self._items)}
        empty = ReasoningItem(id=self._reasoning.id, status="in_progress", content=[])
        return [
            self._event("response.output_item.added", output_index=len(self._items), item=empty),
            self._event(
                "response.content_part.added", **where, content_index=0, part=ReasoningText(text="")
            ),
        ]

    def _close_item(self, status: str) -> list[ResponseEvent]:
        """The events that finish the item being written (none when there is none)."""
        index = len(self._items)
        events: list[ResponseEvent] = []
        if self._message is not None:
            message, self._message = self._message, None
            part = message.content[0]
            where: dict[str, Any] = {"item_id": message.id, "output_index": index}
            message.status = status  # type: ignore[assignment]
            events += [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part.text,
                    logprobs=[TextLogprob.of(item) for item in part.logprobs or ()],
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=message),
            ]
            self._items.append(message)
        elif self._reasoning is not None:
            reasoning, self._reasoning = self._reasoning, None
            thought = reasoning.content[0]
            where = {"item_id": reasoning.id, "output_index": index}
            reasoning.status = status  # type: ignore[assignment]
            events += [
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=thought.text
                ),
                self._event("response.content_part.done", **where, content_index=0, part=thought),
                self._event("response.output_item.done", output_index=index, item=reasoning),
            ]
            self._items.append(reasoning)
        elif self._call is not None:
            call, self._call = self._call, None
            if status == "completed":  # a call cut short keeps what was written of it
                call.arguments = call.arguments or "{}"
            call.status = status  # type: ignore[assignment]
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=call.id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                ),
                self._event("response.output_item.done", output_index=index, item=call),
            ]
            self._items.append(call)
        return events

    def _event(self, type: str, **fields: Any) -> ResponseEvent:
        event = ResponseStreamEvent(type=type, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return type, json_text(event.dump())

    def _text_delta(self, item_id: str, output_index: int, text: str) -> ResponseEvent:
        """A `response.output_text.delta`: the JSON `_event` writes for it, with only the
        strings encoded (a token's event costs no model)."""
        sequence = self._sequence
        self._sequence += 1
        return _TEXT_DELTA, (
            f'{{"type":"{_TEXT_DELTA}","sequence_number":{sequence},'
            f'"output_index":{output_index},"content_index":0,'
            f'"item_id":{encode_basestring_ascii(item_id)},'
            f'"delta":{encode_basestring_ascii(text)},"logprobs":[]}}'
        )
