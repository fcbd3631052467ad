"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API over the
engine's chat path.

A request is decided before the first byte, as on the OpenAI routes: validation, the chat
template, the context check and admission (`start`: a bounded wait, or 529) all raise
`APIError`, which the app answers in Anthropic's error shape. A request for a message `thread`
(the SDK's tool runner asks for one first) is refused with `thread_unsupported_request`: nothing
is held between requests, and the client sends the whole conversation instead.

The admitted request is owned by the HTTP request's ASGI call (`ownership`), so a client that
goes away at any point — while queued, mid-prefill, mid-stream, before the body's first byte —
aborts it and frees its slot; in a batch, the other sequences go on.

With `tools` (`anthropic/tools.py` on `http/tooling.py`), the answer's text is read by the model
family's call reader: its calls are `tool_use` blocks (`id` `toolu_...`, `name`, `input`), its
other text `text` blocks, in the order written (`blocks.ContentWriter`), whole or streamed. A
call cut short (by `max_tokens`, or a stop sequence inside its arguments) is the answer's last
block, as in Anthropic's answers: a `tool_use` block of what its input got whole, under the stop
reason that cut it (never `tool_use`).

`stop_reason`: `end_turn` (the model's end of turn, EOS), `stop_sequence` (with the sequence in
`stop_sequence`), `tool_use` (the answer made calls and was not cut short; `stop_sequence` still
names a stop sequence that ended it), `max_tokens` (the request's `max_tokens`),
`model_context_window_exceeded` (the context ran out first). A model whose tokenizer has thinking
tags answers with a `thinking` block before the `text` block; an answer without calls has one
`text` block, empty if the model said nothing.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from trio_mlx.actors.request import ActiveRequest
from trio_mlx.engine.prompts import renders_reasoning
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.anthropic import tools
from trio_mlx.http.anthropic.blocks import ContentWriter
from trio_mlx.http.anthropic.conversation import Conversation, conversation
from trio_mlx.http.anthropic.objects import (
    Message,
    MessageUsage,
    StopReason,
    TokenCount,
)
from trio_mlx.http.anthropic.requests import CountTokensRequest, MessagesRequest
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import (
    failure,
    prepare_async,
    raise_failure,
    run_to_end,
    start,
)
from trio_mlx.http.state import ServerState
from trio_mlx.http.tooling import CallReader, ToolPlan
from trio_mlx.structured.formats import OutputFormat
from trio_mlx.tools import Content, Reasoning, ToolEvent
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, GenerationOutput

#: Engine parameter names as the Messages API calls them (in error messages).
_PARAMS = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def check_supported(body: CountTokensRequest) -> None:
    """Refuse `thinking` enabled without its budget."""
    thinking = body.thinking
    if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is None:
        raise APIError(
            400,
            "thinking of type 'enabled' needs budget_tokens",
            param="thinking.budget_tokens",
            code="missing_required_parameter",
        )


def check_served(body: MessagesRequest) -> None:
    """Refuse what a Messages request asks of Anthropic's servers that this one does not do:
    hold a `thread` between requests, connect to `mcp_servers`."""
    if body.thread is not None:
        raise APIError(
            400,
            "message threads are not served: this server holds no conversation between "
            "requests; send the whole conversation without `thread`",
            param="thread",
            code="thread_unsupported_request",
        )
    if body.mcp_servers:
        raise APIError(
            400,
            "MCP servers are not connected by this server: run them in the client and give "
            "their tools as client tools (`tools`)",
            param="mcp_servers",
            code="unsupported_value",
        )


def _planned(state: ServerState, body: CountTokensRequest) -> tuple[Conversation, ToolPlan]:
    """The request's conversation, and how its tools reach the model (`tools.plan`)."""
    check_supported(body)
    engine, _ = state.engine_for(body.model)
    chat = conversation(body, keep_reasoning=renders_reasoning(engine.tokenizer))
    try:
        plan = tools.plan(
            body,
            chat.messages,
            tokenizer=engine.tokenizer,
            parser=state.settings.tool_call_parser,
        )
    except APIError as exc:  # about the conversation as planned: the request's own field
        chat.name_field(exc)
        raise
    return chat, plan


def _name_fields(exc: APIError, chat: Conversation, plan: ToolPlan) -> None:
    """Name the request's own field in an error about what the engine was given."""
    if exc.param in _PARAMS:
        exc.param = _PARAMS[exc.param]
    else:
        chat.name_field(exc, added=len(plan.messages) - len(chat.messages))


async def count_tokens(state: ServerState, body: CountTokensRequest) -> dict[str, Any]:
    """`{"input_tokens": N}`: the length of the prompt `/v1/messages` would prefill for the same
    conversation (the chat template's rendering, prefill and tools included), whatever the
    context. With images (a vision-language model), the prompt is prepared as `/v1/messages`
    prepares it, images fetched and processed, so it must fit the context."""
    engine, _ = state.engine_for(body.model)
    chat, plan = _planned(state, body)
    try:
        if chat.has_media:
            prepared = await prepare_async(
                lambda: engine.prepare_chat_async(
                    plan.messages,
                    max_tokens=1,
                    tools=plan.template_tools,
                    chat_template_kwargs=chat.template_kwargs,
                )
            )
            count = len(prepared.prompt_tokens)
        else:
            count = await prepare_async(
                lambda: engine.count_chat_tokens_async(
                    plan.messages,
                    tools=plan.template_tools,
                    chat_template_kwargs=chat.template_kwargs,
                )
            )
    except APIError as exc:
        _name_fields(exc, chat, plan)
        raise
    return TokenCount(input_tokens=count).dump()


def _output_format(body: MessagesRequest) -> OutputFormat | None:
    """The structured output `output_config.format` (or the beta's `output_format`) asks for."""
    if body.output_config is not None and body.output_config.format is not None:
        schema, param = body.output_config.format.schema_, "output_config.format"
    elif body.output_format is not None:
        schema, param = body.output_format.schema_, "output_format"
    else:
        return None
    return OutputFormat.json_schema(schema, strict=False, param=param)


async def start_message(
    state: ServerState, body: MessagesRequest, record: RequestRecord
) -> MessageRun:
    """Validate, prepare and admit one Messages request; raises `APIError` before any byte."""
    engine, model = state.engine_for(body.model)
    record.model = model
    check_served(body)
    chat, plan = _planned(state, body)
    options: dict[str, Any] = dict(plan.options)
    if body.top_k is not None:
        options["top_k"] = body.top_k
    if body.thinking is not None and body.thinking.type == "enabled":
        options["thinking_token_budget"] = body.thinking.budget_tokens
    output_format = _output_format(body)
    if output_format is not None and chat.prefill:
        raise APIError(  # the grammar would hold the continuation alone to the schema
            400,
            "structured output cannot continue a prefilled assistant turn: leave it out",
            param=output_format.param,
            code="invalid_value",
        )
    if output_format is not None:  # a forced tool call's grammar (plan.options) comes first
        options.setdefault("output_format", output_format)
    try:
        active = await start(
            lambda: engine.start_chat(
                plan.messages,
                max_tokens=body.max_tokens,
                temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
                stop=body.stop_sequences,
                tools=plan.template_tools,
                chat_template_kwargs=chat.template_kwargs,
                arrival=record.arrival,
                **options,
            )
        )
    except APIError as exc:
        _name_fields(exc, chat, plan)
        raise
    record.prompt_tokens = active.stream.prompt_tokens
    return MessageRun(
        model, body.max_tokens, active.stream.prompt_tokens, active, record, plan.reader()
    )


class MessageRun:
    """One admitted Messages request: its final `Message`, or (`stream.message_events`) its
    events. Whichever reads it closes the request when it ends, however it ends. With tools,
    `reader` reads the calls out of the answer's text (None: the text is all content)."""

    def __init__(
        self,
        model: str,
        max_tokens: int,
        prompt_tokens: int,
        active: ActiveRequest,
        record: RequestRecord,
        reader: CallReader | None = None,
    ) -> None:
        self.id = new_message_id()
        self.model = model
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.active = active
        self.record = record
        self.reader = reader

    def events(self, out: GenerationOutput) -> list[ToolEvent]:
        """What one output adds to the answer: its reasoning, then its text as the call reader
        reads it (at the end of a successful answer, with what the reader held back)."""
        events: list[ToolEvent] = []
        if out.new_reasoning:
            events.append(Reasoning(out.new_reasoning))
        if self.reader is None:
            if out.new_text:
                events.append(Content(out.new_text))
            return events
        events += self.reader.feed(out.new_text)
        if out.finished and failure(out) is None:
            events += self.reader.finish()
        return events

    def stop_reason(self, final: GenerationOutput, calls: int = 0) -> StopReason:
        """Why the answer ended: `tool_use` when it made calls and was not cut short. `calls`:
        the calls begun; only those the reader counts whole are made (a stop sequence met inside
        a forced call's JSON leaves it unmade)."""
        if final.finish_reason == "length":
            if final.completion_tokens < self.max_tokens:
                return "model_context_window_exceeded"
            return "max_tokens"
        if self.reader is not None:
            calls = min(calls, self.reader.calls)
        if calls:
            return "tool_use"
        return "stop_sequence" if final.stop_sequence is not None else "end_turn"

    def message(self, final: GenerationOutput) -> Message:
        """The whole answer, its blocks written as the stream writes them: a call cut short is
        there as it is in the stream (a `tool_use` block of what its input got whole; the stop
        reason, not `tool_use`, says it was not made)."""
        whole = dataclasses.replace(final, new_text=final.text, new_reasoning=final.reasoning)
        blocks = ContentWriter()
        blocks.feed(self.events(whole))
        blocks.finish()
        return Message(
            id=self.id,
            model=self.model,
            content=blocks.content(),
            stop_reason=self.stop_reason(final, blocks.calls),
            stop_sequence=final.stop_sequence,
            usage=MessageUsage.of(final),
        )

    async def final(self) -> dict[str, Any]:
        """Run to the end; the `Message` (a failed or aborted generation raises `APIError`)."""
        last = await run_to_end(self.active, self.record)
        raise_failure(last)
        return self.message(last).dump()
