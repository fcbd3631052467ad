"""`POST /v1/responses` and its WebSocket mode: the Responses API.

`response_events` turns one request into the API's event sequence — `response.created`,
`response.in_progress`, then each output item: a message (`response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` per piece of text,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`) or a
function call (`response.output_item.added` with the `function_call` item,
`response.function_call_arguments.delta` per piece of its arguments,
`response.function_call_arguments.done`, `response.output_item.done`); then
`response.completed` (or `response.incomplete` when `max_output_tokens` ran out,
`response.failed` when generation failed). Without tools the reply is one message, opened before
the first token; with tools (`http/tooling.py`) a message is opened by its first text and a
call closes the item before it. The SSE route frames the events with `event:` lines (no
`[DONE]`: the Responses API has none); the WebSocket sends each as one JSON message; the
non-streaming route returns the final response.

Input items: messages, earlier `function_call`s (one assistant turn with their calls) and their
`function_call_output`s (tool results) become the chat-template conversation.

Validation and admission errors are raised (as `APIError`) before the first event. A client that
goes away aborts the generation at the next step boundary.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator
from typing import Any

from trio_mlx.actors.engine import Engine
from trio_mlx.actors.request import ActiveRequest
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.chat import template_messages
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import failure, new_id, outputs, run_to_end, start
from trio_mlx.http.objects import (
    ErrorDetail,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseStreamEvent,
    ResponseUsage,
)
from trio_mlx.http.requests import ChatMessage
from trio_mlx.http.responses_requests import InputItem, ResponsesRequest
from trio_mlx.http.state import ServerState
from trio_mlx.http.structured_output import responses_output_format
from trio_mlx.http.tooling import CallReader, plan_tools
from trio_mlx.tools import ArgumentsAppended, CallStarted, Content, ToolEvent
from trio_mlx.types import GenerationOutput

_FUNCTION_PARAMETERS = re.compile(r"^tools\[(\d+)\]\.function\.parameters")


def input_messages(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[int]]:
    """`instructions` and `input` as chat-template messages, and for each message the input item
    it comes from (-1: `instructions`), to name a refused field as the client sent it."""
    messages: list[ChatMessage] = []
    where: list[int] = []  # the input item each message comes from (-1: instructions)
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
        where.append(-1)
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
        where.append(0)
    else:
        for i, item in enumerate(body.input):
            message = _item_message(item, i, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
                where.append(i)
    try:
        return template_messages(messages), where
    except APIError as exc:
        name_input_field(exc, where)
        raise


def name_input_field(exc: APIError, where: list[int]) -> None:
    """Name the field as the client sent it: `messages[i]` is the input item that message came
    from (`where[i]`, -1 for `instructions`)."""
    if not exc.param or not exc.param.startswith("messages"):
        return
    if not exc.param.startswith("messages["):
        exc.param = "input" + exc.param[len("messages") :]
        return
    index = int(exc.param[len("messages[") :].split("]")[0])
    rest = exc.param.split("]", 1)[1]
    if 0 <= index < len(where):
        exc.param = f"input[{where[index]}]{rest}" if where[index] >= 0 else "instructions"


def _item_message(item: InputItem, i: int, previous: ChatMessage | None) -> ChatMessage | None:
    """The chat message an input item becomes; None when it joined `previous` (a call of the
    same assistant turn)."""
    if item.type == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            missing = next(k for k in ("call_id", "name", "arguments") if getattr(item, k) is None)
            raise APIError(
                400,
                f"a function_call item needs {missing}",
                param=f"input[{i}].{missing}",
                code="missing_required_parameter",
            )
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        if previous is not None and previous.role == "assistant":
            previous.tool_calls = [*(previous.tool_calls or []), call]
            return None
        return ChatMessage(role="assistant", content=None, tool_calls=[call])
    if item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            missing = "call_id" if item.call_id is None else "output"
            raise APIError(
                400,
                f"a function_call_output item needs {missing}",
                param=f"input[{i}].{missing}",
                code="missing_required_parameter",
            )
        return ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
    if item.role is None or item.content is None:
        missing = "role" if item.role is None else "content"
        raise APIError(
            400,
            f"a message item needs {missing}",
            param=f"input[{i}].{missing}",
            code="missing_required_parameter",
        )
    return ChatMessage(role=item.role, content=item.content)


async def start_response(
    state: ServerState, body: ResponsesRequest, record: RequestRecord
) -> ResponseRun:
    """Validate and admit a Responses request; raises `APIError` before anything is sent."""
    body.check_supported()
    engine, model = state.engine_for(body.model)
    record.model = model
    messages, where = input_messages(body)
    try:
        plan = plan_tools(
            messages,
            body.chat_tools(),
            body.tool_choice,
            body.parallel_tool_calls,
            tokenizer=engine.tokenizer,
            parser=state.settings.tool_call_parser,
            nested_choice=False,
        )
    except APIError as exc:  # about a tool's schema, in the chat shape: the request's field
        exc.param = _FUNCTION_PARAMETERS.sub(r"tools[\1].parameters", exc.param or "") or None
        raise
    options = body.sampling_options() | plan.options
    output_format = responses_output_format(body.text.format if body.text else None)
    if output_format is not None:  # a forced tool call's grammar (plan.options) comes first:
        options.setdefault("output_format", output_format)  # its reply has no content
    try:
        active = await start(
            lambda: engine.start_chat(
                plan.messages,
                max_tokens=body.max_output_tokens,
                tools=plan.template_tools,
                arrival=record.arrival,
                **options,
            )
        )
    except APIError as exc:  # a media part the engine refused
        added = len(plan.messages) - len(messages)  # a system prompt offering the tools
        name_input_field(exc, [-1] * added + where)
        raise
    record.prompt_tokens = active.stream.prompt_tokens
    return ResponseRun(engine, model, body, active, record, plan.reader())


class ResponseRun:
    """One admitted response: its events, or its final object."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        body: ResponsesRequest,
        active: ActiveRequest,
        record: RequestRecord,
        calls: CallReader | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.body = body
        self.active = active
        self.record = record
        #: Reads function calls out of the reply (None: the reply is one message).
        self.calls = calls
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self._sequence = 0
        #: Output items finished so far, and the one being written.
        self._items: list[OutputItem] = []
        self._message: OutputMessage | None = None
        self._call: FunctionCallItem | None = None

    def close(self) -> None:
        self.active.close()

    def response(
        self,
        status: str,
        output: list[OutputItem] | None = None,
        final: GenerationOutput | None = None,
    ) -> ResponseObject:
        output = output or []
        texts = [
            part.text for item in output if isinstance(item, OutputMessage) for part in item.content
        ]
        usage = None
        incomplete = None
        error = None
        if final is not None:
            usage = ResponseUsage(
                input_tokens=final.prompt_tokens,
                output_tokens=final.completion_tokens,
                total_tokens=final.prompt_tokens + final.completion_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=final.cached_tokens),
            )
            if final.finish_reason == "length":
                incomplete = IncompleteDetails(reason="max_output_tokens")
            failed = failure(final)
            if failed is not None:
                error = ErrorDetail(**failed["error"])
        body = self.body
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            model=self.model,
            output=output,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            incomplete_details=incomplete,
            error=error,
            usage=usage,
            metadata=body.metadata or {},
            output_text="".join(texts) if texts else None,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )

    def _event(self, type: str, **fields: Any) -> dict[str, Any]:
        event = ResponseStreamEvent(type=type, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event.dump()

    async def final(self) -> dict[str, Any]:
        """Run to the end; the response object (completed, incomplete or failed)."""
        last = await run_to_end(self.active, self.record)
        status = _status(last)
        item_status = "incomplete" if status == "incomplete" else "completed"
        if self.calls is None:
            output: list[OutputItem] = [self._new_message(last.text, item_status)]
        else:
            parsed = self.calls.parse(last.text)
            output = []
            if parsed.content or not parsed.calls:
                output.append(self._new_message(parsed.content, item_status))
            output += [
                FunctionCallItem(
                    id=new_id("fc"),
                    call_id=call.id,
                    name=call.name,
                    arguments=call.arguments,
                    status=item_status,  # type: ignore[arg-type]
                )
                for call in parsed.calls
            ]
        return self.response(status, output, last).dump()

    def _new_message(self, text: str | None, status: str) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=new_id("msg"), status=status, content=content)  # type: ignore[arg-type]

    async def events(self) -> AsyncGenerator[dict[str, Any]]:
        """The event sequence of a streamed response."""
        last: GenerationOutput | None = None
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            if self.calls is None:  # one message, opened before the first token
                for event in self._open_message():
                    yield event
            async for out in outputs(self.active):
                last = out
                if not out.finished:
                    for event in self._reply_events(out.new_text, finish=False):
                        yield event
                    continue
                status = _status(out)
                if status != "failed":
                    for event in self._reply_events(out.new_text, finish=True):
                        yield event
                    item_status = "incomplete" if status == "incomplete" else "completed"
                    if self._call is not None and self._cut_call():
                        item_status = "incomplete"
                    for event in self._close_item(item_status):
                        yield event
                output = [*self._items, *([self._message] if self._message else [])]
                yield self._event(f"response.{status}", response=self.response(status, output, out))
                return
        finally:
            self.close()
            self.record.finish(last)

    def _cut_call(self) -> bool:
        """Whether the call being written is one the reader does not count whole (a forced
        call's JSON that a stop string cut)."""
        started = 1 + sum(isinstance(item, FunctionCallItem) for item in self._items)
        return self.calls is not None and self.calls.calls < started

    def _reply_events(self, text: str, *, finish: bool) -> list[dict[str, Any]]:
        parsed: list[ToolEvent]
        if self.calls is None:
            parsed = [Content(text)] if text else []
        else:
            parsed = self.calls.feed(text) + (self.calls.finish() if finish else [])
        events = []
        for event in parsed:
            if isinstance(event, Content):
                if self._message is None:
                    events += self._close_item("completed") + self._open_message()
                assert self._message is not None
                self._message.content[0].text += event.text
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=self._message.id,
                        output_index=len(self._items),
                        content_index=0,
                        delta=event.text,
                        logprobs=[],
                    )
                )
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

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = OutputMessage(
            id=new_id("msg"), status="in_progress", content=[OutputText(text="")]
        )
        where: dict[str, Any] = {"item_id": self._message.id, "output_index": len(self._items)}
        empty = OutputMessage(id=self._message.id, status="in_progress", content=[])
        return [
            self._event("response.output_item.added", output_index=len(self._items), item=empty),
            self._event(
                "response.content_part.added", **where, content_index=0, part=OutputText(text="")
            ),
        ]

    def _close_item(self, status: str) -> list[dict[str, Any]]:
        """The events that finish the item being written (none when there is none)."""
        index = len(self._items)
        events = []
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
                    logprobs=[],
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=message),
            ]
            self._items.append(message)
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


def _status(final: GenerationOutput) -> str:
    if final.finish_reason in ("error", "abort"):
        return "failed"
    return "incomplete" if final.finish_reason == "length" else "completed"
