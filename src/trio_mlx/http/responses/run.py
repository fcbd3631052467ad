"""An admitted Responses request (`POST /v1/responses`, a `response.create` on its WebSocket):
its response object, and the whole response of a request that does not stream.

`start_response` validates and admits a request (`prompt.ResponsePrompt`, then the engine's
`start_chat`): every refusal is an `APIError`, raised before the first byte or event. The
`ResponseRun` it returns owns the admitted request: the whole response runs it to its end
(`final`), a stream reads it event by event (`stream.response_events`); either closes it when it
ends, fails or is cancelled, so a client that goes away aborts the generation at the next step
boundary. A failed generation is a response whose `status` is `failed`, with its `error`.
"""

from __future__ import annotations

import time
from typing import Any

from trio_mlx.actors.engine import Engine
from trio_mlx.actors.request import ActiveRequest
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import TokenText, failure, new_id, run_to_end, start
from trio_mlx.http.objects import (
    ConversationRef,
    ErrorDetail,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
    TokenLogprobOut,
)
from trio_mlx.http.responses.prompt import CONTEXT_LENGTH_EXCEEDED, ResponsePrompt
from trio_mlx.http.responses.reply_tokens import ReplyTokens
from trio_mlx.http.responses.requests import ResponsesRequest
from trio_mlx.http.responses.store import LaneCache, ResponseKeeper
from trio_mlx.http.state import ServerState
from trio_mlx.http.structured_output import responses_output_format
from trio_mlx.http.tooling import CallReader
from trio_mlx.tools import Content, Reasoning, ToolEvent
from trio_mlx.types import GenerationOutput


async def start_response(
    state: ServerState,
    body: ResponsesRequest,
    record: RequestRecord,
    connection: LaneCache | None = None,
) -> ResponseRun:
    """Validate and admit a Responses request (on a WebSocket, `connection` is its lane's view
    of the connection's cache of responses); raises `APIError` before anything is sent. With
    `truncation: "auto"`, a conversation the context cannot hold is truncated
    (`ResponsePrompt.truncate`) and admitted again."""
    prompt = ResponsePrompt(state, body, connection)
    record.model = prompt.model
    try:
        active = await _admit(prompt, body, record)
    except APIError as exc:
        if exc.code != CONTEXT_LENGTH_EXCEEDED or body.truncation != "auto":
            raise
        if not await prompt.truncate():
            raise
        active = await _admit(prompt, body, record)
    record.prompt_tokens = active.stream.prompt_tokens
    reasons = active.stream.splits_reasoning
    plan = prompt.plan
    turn = prompt.conversation
    keeper = ResponseKeeper(
        prompt.items,
        prompt.previous,
        state.responses if body.stored else None,
        connection,
        turn.appender(prompt.request_items) if turn is not None else None,
    )
    # A whole response with tools reads its reply a second time, output by output as a stream
    # does, to tell the tokens of its text and reasoning from its calls' (`ReplyTokens`).
    second = plan.reader()
    return ResponseRun(
        prompt.engine,
        prompt.model,
        body,
        active,
        record,
        plan.reader(),
        second,
        reasons=reasons,
        keeper=keeper,
    )


async def _admit(
    prompt: ResponsePrompt, body: ResponsesRequest, record: RequestRecord
) -> ActiveRequest:
    """Start the prompt's generation with the request's options (`generation.start`)."""
    engine, plan = prompt.engine, prompt.plan
    options = body.sampling_options() | plan.options
    if body.logprobs:
        options["logprobs"] = True
        options["top_logprobs"] = body.top_logprobs or 0
    output_format = responses_output_format(body.text.format if body.text else None)
    if output_format is not None:  # a forced tool call's grammar (plan.options) comes first:
        options.setdefault("output_format", output_format)  # its reply has no content
    try:
        return await start(
            lambda: engine.start_chat(
                plan.messages,
                max_tokens=body.max_output_tokens,
                tools=plan.template_tools,
                arrival=record.arrival,
                **options,
            )
        )
    except APIError as exc:  # a media part the engine refused, a prompt too long
        prompt.name_field(exc)
        raise


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
    """One admitted response: what its object says, and its whole response (`final`); a stream
    reads it through `stream.ResponseEvents`."""

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
        keeper: ResponseKeeper | None = None,
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
        self.reasons = reasons
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self._token_text = TokenText(engine.tokenizer)
        #: With `include: ["message.output_text.logprobs"]`.
        self.logprobs = body.logprobs
        #: Where the response is kept when it ends (None: nowhere).
        self._keeper = keeper

    def end(self, response: ResponseObject) -> None:
        """The response ended (its final object): keep it where it is kept (`store`), before
        its last event or whole object is sent, so that a client can continue it at once."""
        keeper = self._keeper
        if keeper is None:
            return
        if response.status == "failed":
            keeper.failed(self.body.previous_response_id)
        elif keeper.keeps:
            keeper.keep(response.dump())

    def close(self) -> None:
        """Close the admitted request (its slot is free; an unfinished generation is aborted)."""
        self.active.close()

    def reply_tokens(self) -> ReplyTokens:
        """A reader of which of the reply's tokens wrote what, as this reply needs it."""
        plain = self.calls is None
        simple = (plain or not self.logprobs) and not self.reasons
        return ReplyTokens(self._token_text, plain=plain, simple=simple)

    def response(
        self,
        status: str,
        output: list[OutputItem] | None = None,
        final: GenerationOutput | None = None,
        reasoning_tokens: int = 0,
    ) -> ResponseObject:
        """The response object at `status`, with `output` so far; `final`, the last output,
        gives its usage, why it is incomplete or what failed."""
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
        conversation = body.conversation_id
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            model=self.model,
            output=output,
            previous_response_id=body.previous_response_id,
            conversation=ConversationRef(id=conversation) if conversation is not None else None,
            store=body.stored,
            background=body.background is True,
            truncation=body.truncation or "disabled",
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

    async def final(self) -> dict[str, Any]:
        """Run to the end; the response object (completed, incomplete or failed)."""
        tokens: ReplyTokens | None = None  # which tokens wrote the text and the reasoning
        if self.logprobs or self.reasons or self.calls is not None:
            tokens = self.reply_tokens()
        reader = self._second_calls

        def read(out: GenerationOutput) -> None:
            assert tokens is not None
            tokens.note(out.new_tokens)
            for event in reply_events(out, reader):
                tokens.read(event)

        last = await run_to_end(self.active, self.record, read if tokens is not None else None)
        text_tokens = [*tokens.text, *tokens.end()] if tokens is not None else []
        status = response_status(last)
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
        response = self.response(status, output, last, counted)
        self.end(response)
        return response.dump()

    def _new_message(
        self, text: str | None, status: str, final: GenerationOutput, tokens: list[int]
    ) -> OutputMessage:
        """The message of a whole response; `tokens`: the positions of its text's tokens."""
        logprobs = self.text_logprobs(final, tokens) if self.logprobs else None
        content = [] if text is None else [OutputText(text=text, logprobs=logprobs)]
        return OutputMessage(id=new_id("msg"), status=status, content=content)  # type: ignore[arg-type]

    def text_logprobs(self, out: GenerationOutput, tokens: list[int]) -> list[TokenLogprobOut]:
        """The logprobs of the reply's tokens at `tokens` (positions), in the part's shape."""
        every = out.logprobs or []
        return self._token_text.token_logprobs([every[i] for i in tokens if i < len(every)])


def response_status(final: GenerationOutput) -> str:
    """The response's `status` for its final output."""
    if final.finish_reason in ("error", "abort"):
        return "failed"
    return "incomplete" if final.finish_reason == "length" else "completed"
