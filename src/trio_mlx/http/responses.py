"""`POST /v1/responses` and its WebSocket mode: the Responses API.

`response_events` turns one request into the API's event sequence — `response.created`,
`response.in_progress`, then each output item: a message (`response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` per piece of text,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`) or a
function call (`response.output_item.added` with the `function_call` item,
`response.function_call_arguments.delta` per piece of its arguments,
`response.function_call_arguments.done`, `response.output_item.done`) or the model's reasoning
(a model whose tokenizer has thinking tags: `response.output_item.added` with the `reasoning`
item, `response.content_part.added` with its `reasoning_text` part, one
`response.reasoning_text.delta` per piece, `response.reasoning_text.done`,
`response.content_part.done`, `response.output_item.done`); then `response.completed` (or
`response.incomplete` when `max_output_tokens` ran out, `response.failed` when generation
failed). Without tools or reasoning the reply is one message, opened before the first token;
otherwise an item is opened by its first piece and closes the item before it, and a reply
without tools ends with a message (empty if it wrote no text). The SSE route frames the events
with `event:` lines (no `[DONE]`: the Responses API has none); the WebSocket sends each as one
JSON message; the non-streaming route returns the final response.

Input items: messages, earlier `function_call`s (one assistant turn with their calls) and their
`function_call_output`s (tool results) become the chat-template conversation. An earlier
`reasoning` item goes with the assistant turn after it, as its `reasoning_content`, where the
model's chat template renders reasoning; where it does not, it is left out, as the template
leaves out the reasoning of earlier turns (the Responses API hands reasoning items back to be
sent again, and decides itself which it keeps).

Validation and admission errors are raised (as `APIError`) before the first event. A client that
goes away aborts the generation at the next step boundary.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator
from json.encoder import encode_basestring_ascii
from typing import Any

from trio_mlx.actors.engine import Engine
from trio_mlx.actors.request import ActiveRequest
from trio_mlx.engine.prompts import renders_reasoning
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.chat import template_messages
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import (
    TokenText,
    failure,
    json_text,
    new_id,
    prepare_async,
    run_to_end,
    start,
)
from trio_mlx.http.objects import (
    ErrorDetail,
    FunctionCallItem,
    IncompleteDetails,
    InputTokenCount,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseStreamEvent,
    ResponseUsage,
    TextLogprob,
    TokenLogprobOut,
)
from trio_mlx.http.requests import ChatMessage
from trio_mlx.http.responses_requests import InputItem, InputTokensRequest, ResponsesRequest
from trio_mlx.http.state import ServerState
from trio_mlx.http.structured_output import responses_output_format
from trio_mlx.http.tooling import CallReader, plan_tools
from trio_mlx.tools import ArgumentsAppended, CallStarted, Content, Reasoning, ToolEvent
from trio_mlx.types import GenerationOutput

_FUNCTION_PARAMETERS = re.compile(r"^tools\[(\d+)\]\.function\.parameters")

#: One event of the stream as it is sent: its type and its JSON text (the SSE `event:` and
#: `data:`, or one WebSocket message).
ResponseEvent = tuple[str, str]
_TEXT_DELTA = "response.output_text.delta"


def input_messages(
    body: ResponsesRequest | InputTokensRequest, *, keep_reasoning: bool = False
) -> tuple[list[dict[str, Any]], list[int]]:
    """`instructions` and `input` as chat-template messages, and for each message the input item
    it comes from (-1: `instructions`), to name a refused field as the client sent it.
    `keep_reasoning`: the template renders reasoning, so `reasoning` items become the next
    assistant turn's `reasoning_content` (else they are left out)."""
    messages: list[ChatMessage] = []
    where: list[int] = []  # the input item each message comes from (-1: instructions)
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
        where.append(-1)
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
        where.append(0)
    elif body.input is not None:
        reasoning: list[str] = []  # reasoning items waiting for the assistant turn after them
        for i, item in enumerate(body.input):
            if item.type == "reasoning":
                text = item.reasoning(i)
                if keep_reasoning and text:
                    reasoning.append(text)
                continue
            message = _item_message(item, i, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
                where.append(i)
            turn = message or messages[-1]
            if reasoning and turn.role == "assistant":
                earlier = [turn.reasoning_content] if turn.reasoning_content else []
                turn.reasoning_content = "\n".join([*earlier, *reasoning])
            reasoning = []
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


class _Prompt:
    """A request's conversation as the engine takes it: its template messages (with what the
    tool plan adds), and where each came from (`where`: the input item, -1 for `instructions`
    or a message the plan added)."""

    def __init__(self, state: ServerState, body: ResponsesRequest | InputTokensRequest) -> None:
        body.check_supported()
        self.engine, self.model = state.engine_for(body.model)
        tokenizer = self.engine.tokenizer
        messages, where = input_messages(body, keep_reasoning=renders_reasoning(tokenizer))
        try:
            self.plan = plan_tools(
                messages,
                body.chat_tools(),
                body.tool_choice,
                body.parallel_tool_calls,
                tokenizer=tokenizer,
                parser=state.settings.tool_call_parser,
                nested_choice=False,
            )
        except APIError as exc:  # about a tool's schema, in the chat shape: the request's field
            exc.param = _FUNCTION_PARAMETERS.sub(r"tools[\1].parameters", exc.param or "") or None
            raise
        self.where = [-1] * (len(self.plan.messages) - len(messages)) + where

    def name_field(self, exc: APIError) -> None:
        """Name the request's own field in an error about a message the engine was given."""
        name_input_field(exc, self.where)


async def count_input_tokens(state: ServerState, body: InputTokensRequest) -> dict[str, Any]:
    """`{"object": "response.input_tokens", "input_tokens": N}`: the length of the prompt
    `POST /v1/responses` would prefill for the same fields (the chat template's rendering,
    tools included). With media (a vision-language model) the prompt is prepared as a response
    prepares it, the media fetched and processed, so it must fit the context."""
    prompt = _Prompt(state, body)
    engine, plan = prompt.engine, prompt.plan
    try:
        if any(isinstance(message["content"], list) for message in plan.messages):
            prepared = await prepare_async(
                lambda: engine.prepare_chat_async(
                    plan.messages, max_tokens=1, tools=plan.template_tools
                )
            )
            count = len(prepared.prompt_tokens)
        else:
            count = await prepare_async(
                lambda: engine.count_chat_tokens_async(plan.messages, tools=plan.template_tools)
            )
    except APIError as exc:
        prompt.name_field(exc)
        raise
    return InputTokenCount(input_tokens=count).dump()


async def start_response(
    state: ServerState, body: ResponsesRequest, record: RequestRecord
) -> ResponseRun:
    """Validate and admit a Responses request; raises `APIError` before anything is sent."""
    prompt = _Prompt(state, body)
    engine, plan = prompt.engine, prompt.plan
    record.model = model = prompt.model
    options = body.sampling_options() | plan.options
    if body.logprobs:
        options["logprobs"] = True
        options["top_logprobs"] = body.top_logprobs or 0
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
        prompt.name_field(exc)
        raise
    record.prompt_tokens = active.stream.prompt_tokens
    reasons = active.stream.splits_reasoning
    # A whole response with tools reads its reply a second time, output by output as a stream
    # does, to tell the tokens of its text and reasoning from its calls' (`ReplyTokens`).
    second = plan.reader()
    return ResponseRun(engine, model, body, active, record, plan.reader(), second, reasons=reasons)


def reply_events(out: GenerationOutput, calls: CallReader | None) -> list[ToolEvent]:
    """What one output adds to the reply: its reasoning, then its text, as the call reader (if
    any) reads it; at the end of a successful reply, what the reader held back."""
    events: list[ToolEvent] = [Reasoning(out.new_reasoning)] if out.new_reasoning else []
    if calls is None:
        return events + ([Content(out.new_text)] if out.new_text else [])
    events += calls.feed(out.new_text)
    if out.finished and failure(out) is None:
        events += calls.finish()
    return events


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
        second_calls: CallReader | None = None,
        *,
        reasons: bool = False,
    ) -> None:
        self.engine = engine
        self.model = model
        self.body = body
        self.active = active
        self.record = record
        #: Reads function calls out of the reply (None: the reply is one message), and a second
        #: reader for a whole response to read the reply as a stream does (`ReplyTokens`).
        self.calls = calls
        self._second_calls = second_calls
        #: Whether the reply may hold reasoning (the engine separates it).
        self._reasons = reasons
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self._sequence = 0
        #: Output items finished so far, and the one being written.
        self._items: list[OutputItem] = []
        self._message: OutputMessage | None = None
        self._call: FunctionCallItem | None = None
        self._reasoning: ReasoningItem | None = None
        self._token_text = TokenText(engine.tokenizer)
        #: With `include: ["message.output_text.logprobs"]`.
        self._logprobs = body.logprobs
        #: A stream's tokens, as they write its text, reasoning and calls.
        self._tokens = self._reply_tokens()

    def close(self) -> None:
        self.active.close()

    def _reply_tokens(self) -> ReplyTokens:
        plain = self.calls is None
        simple = (plain or not self._logprobs) and not self._reasons
        return ReplyTokens(self._token_text, plain=plain, simple=simple)

    def response(
        self,
        status: str,
        output: list[OutputItem] | None = None,
        final: GenerationOutput | None = None,
        reasoning_tokens: int = 0,
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
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
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
            top_logprobs=body.top_logprobs,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )

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

    # ---- the whole response --------------------------------------------------------------------

    async def final(self) -> dict[str, Any]:
        """Run to the end; the response object (completed, incomplete or failed)."""
        tokens: ReplyTokens | None = None  # which tokens wrote the text and the reasoning
        if self._logprobs or self._reasons or self.calls is not None:
            tokens = self._reply_tokens()
        reader = self._second_calls

        def read(out: GenerationOutput) -> None:
            assert tokens is not None
            tokens.note(out.new_tokens)
            for event in reply_events(out, reader):
                tokens.read(event)

        last = await run_to_end(self.active, self.record, read if tokens is not None else None)
        text_tokens = [*tokens.text, *tokens.end()] if tokens is not None else []
        status = _status(last)
        item_status = "incomplete" if status == "incomplete" else "completed"
        reasoning = last.reasoning
        output: list[OutputItem] = []
        if self.calls is None:
            message = self._new_message(last.text, item_status, last, text_tokens)
        else:
            parsed = self.calls.parse(last.text)
            reasoning += parsed.reasoning
            message = None
            if parsed.content or not parsed.calls:
                message = self._new_message(parsed.content, item_status, last, text_tokens)
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
        if message is not None:
            output.insert(0, message)
        if reasoning:
            item = ReasoningItem(
                id=new_id("rs"),
                content=[ReasoningText(text=reasoning)],
                status=item_status,  # type: ignore[arg-type]
            )
            output.insert(0, item)
        counted = tokens.reasoning if tokens is not None else 0
        return self.response(status, output, last, counted).dump()

    def _new_message(
        self, text: str | None, status: str, final: GenerationOutput, tokens: list[int]
    ) -> OutputMessage:
        """The message of a whole response; `tokens`: the positions of its text's tokens."""
        logprobs = self._text_logprobs(final, tokens) if self._logprobs else None
        content = [] if text is None else [OutputText(text=text, logprobs=logprobs)]
        return OutputMessage(id=new_id("msg"), status=status, content=content)  # type: ignore[arg-type]

    def _text_logprobs(self, out: GenerationOutput, tokens: list[int]) -> list[TokenLogprobOut]:
        """The logprobs of the reply's tokens at `tokens` (positions), in the part's shape."""
        every = out.logprobs or []
        return self._token_text.token_logprobs([every[i] for i in tokens if i < len(every)])

    # ---- the stream ----------------------------------------------------------------------------

    async def events(self) -> AsyncGenerator[list[ResponseEvent]]:
        """The event sequence of a streamed response, in batches: the events that are ready
        together (those before the first token; then each output's), to be written at once."""
        last: GenerationOutput | None = None
        try:
            ready = [
                self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress")),
            ]
            if self.calls is None and not self._reasons:  # one message, before the first token
                ready += self._open_message()
            yield ready
            async for out in self.active.stream:
                last = out
                self._tokens.note(out.new_tokens)
                status = _status(out) if out.finished else None
                if status is None:
                    ready = self._reply_events(out)
                    if ready:
                        yield ready
                    continue
                self.close()  # the slot is free before the last events are written
                ready = []
                if status != "failed":
                    ready += self._reply_events(out)
                    ready += self._end_events(out, status)
                output = [*self._items, *self._open_items()]
                ready.append(
                    self._event(
                        f"response.{status}",
                        response=self.response(status, output, out, self._tokens.reasoning),
                    )
                )
                yield ready
                return
        finally:
            self.close()
            self.record.finish(last)

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
        items = self._text_logprobs(out, tokens)
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


class ReplyTokens:
    """Which of the reply's tokens wrote its text (`output_text` and its logprobs), its
    reasoning (`reasoning_tokens`), or a function call's markup.

    Tokens wait (`note`) for the pieces their text makes (`read`), however many one output
    carries. A piece of text or reasoning takes the waiting tokens up to the end of its text,
    found in theirs (each token's text decoded alone); those before its text held what lies
    between two kinds: a thinking tag (the reasoning's) or the end of a call's markup (no
    one's). A token whose text begins in a piece and ends in what follows (`.<` before
    `<tool_call>`) goes with the piece. Where the piece's text is not found in the tokens'
    (a character split between tokens decodes apart as U+FFFD), it takes every token waiting.
    The tokens left at the end (`end`: an end-of-sequence token, a stop string, which wrote
    nothing of their own) go with what came last, text or reasoning. So without tools or
    reasoning the text has every token, as chat's `logprobs` do.

    `plain`: the reply has no tools (tokens that wrote nothing at all go with the text).
    `simple`: nothing to tell apart (no reasoning, and no tools or nobody asking): a piece of
    text takes every token waiting, none is decoded."""

    def __init__(self, text: TokenText, *, plain: bool, simple: bool = False) -> None:
        self._text = text
        self._plain = plain
        self._simple = simple
        self._waiting: list[tuple[int, int]] = []  # (position in the reply, token id)
        self._count = 0
        self._last = "start"  # what the last piece was: start, text, reasoning or call
        #: The positions of the text's tokens, and how many tokens the reasoning took.
        self.text: list[int] = []
        self.reasoning = 0

    def note(self, tokens: list[int]) -> None:
        self._waiting += [(self._count + i, token) for i, token in enumerate(tokens)]
        self._count += len(tokens)

    def read(self, event: ToolEvent) -> list[int]:
        """The positions of the tokens that wrote `event`, a piece of text ([] for others)."""
        if isinstance(event, CallStarted | ArgumentsAppended):
            self._last = "call"
            return []
        if not isinstance(event, Content | Reasoning):
            return []
        if not event.text:
            return []
        kind = "text" if isinstance(event, Content) else "reasoning"
        lead: list[tuple[int, int]] = []
        if self._simple:
            taken, self._waiting = self._waiting, []
        else:
            lead, taken = self._take(event.text)
        # What lay before the piece's text: a thinking tag, the end of a call's markup.
        between = "reasoning" if "reasoning" in (kind, self._last) else None
        if self._last != "call" and between is None:
            between = "text"
        self._last = kind
        positions: list[int] = []
        for group, owner in ((lead, between), (taken, kind)):
            if owner == "reasoning":
                self.reasoning += len(group)
            elif owner == "text":
                positions += [position for position, _ in group]
        self.text += positions
        return positions

    def end(self) -> list[int]:
        """The positions of the tokens left at the end, if they go with the text."""
        waiting, self._waiting = self._waiting, []
        if self._last == "reasoning":
            self.reasoning += len(waiting)
        if self._last == "text" or (self._last == "start" and self._plain):
            return [position for position, _ in waiting]
        return []

    def _take(self, text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Take the waiting tokens up to the end of `text`: those before it, those of it."""
        starts = []
        written = ""
        for _, token in self._waiting:
            starts.append(len(written))
            written += self._text(token)
        found = _find(written, text, set(starts))
        if found < 0:
            taken, self._waiting = self._waiting, []
            return [], taken
        ends = [*starts[1:], len(written)]
        lead = sum(1 for end in ends if end <= found)
        rest = sum(1 for start in starts if start >= found + len(text))
        cut = len(self._waiting) - rest
        waiting, self._waiting = self._waiting[:cut], self._waiting[cut:]
        return waiting[:lead], waiting[lead:]


def _find(written: str, text: str, starts: set[int]) -> int:
    """Where `text` is in `written`: its first place at the start of a token, else its first
    place; -1 when it is not there."""
    first = found = written.find(text)
    while found >= 0 and found not in starts:
        found = written.find(text, found + 1)
    return found if found >= 0 else first


def _status(final: GenerationOutput) -> str:
    if final.finish_reason in ("error", "abort"):
        return "failed"
    return "incomplete" if final.finish_reason == "length" else "completed"
