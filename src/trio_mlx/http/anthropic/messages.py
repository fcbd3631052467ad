"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API over the
engine's chat path.

A request is decided before the first byte, as on the OpenAI routes: validation, the chat
template, the context check (`prepare_async`) and admission (`admit`: a bounded wait, or 429) all
raise `APIError`, which the app answers in Anthropic's error shape. The admitted request is owned
by the HTTP request's ASGI call (`ownership`), so a client that goes away at any point — while
queued, mid-prefill, mid-stream, before the body's first byte — aborts it and frees its slot; in
a batch, the other sequences go on.

`stop_reason`: `end_turn` (the model's end of turn, EOS), `stop_sequence` (with the sequence in
`stop_sequence`), `max_tokens` (the request's `max_tokens`), `model_context_window_exceeded`
(the context ran out first). A model whose tokenizer has thinking tags answers with a `thinking`
block before the `text` block; there is always one `text` block, empty if the model said nothing.
"""

from __future__ import annotations

import uuid
from typing import Any

from trio_mlx.actors.request import ActiveRequest
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.anthropic.conversation import conversation
from trio_mlx.http.anthropic.objects import (
    Message,
    MessageUsage,
    OutputBlock,
    StopReason,
    TextBlock,
    ThinkingBlock,
    TokenCount,
)
from trio_mlx.http.anthropic.requests import CountTokensRequest, MessagesRequest
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import admit, prepare_async, raise_failure, run_to_end
from trio_mlx.http.state import ServerState
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, GenerationOutput

#: Engine parameter names as the Messages API calls them (in error messages).
_PARAMS = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def check_supported(body: CountTokensRequest) -> None:
    """Refuse what parses but is not served yet (tools, and a `tool_choice` that needs them),
    and `thinking` enabled without its budget."""
    thinking = body.thinking
    if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is None:
        raise APIError(
            400,
            "thinking of type 'enabled' needs budget_tokens",
            param="thinking.budget_tokens",
            code="missing_required_parameter",
        )
    if body.tools:
        raise APIError(
            400,
            "tools are not supported on /v1/messages yet",
            param="tools",
            code="unsupported_value",
        )
    if body.tool_choice is not None and body.tool_choice.type not in ("auto", "none"):
        raise APIError(
            400,
            f"tool_choice {body.tool_choice.type!r} needs tools, which this route does not "
            "serve yet; use 'auto' or 'none'",
            param="tool_choice.type",
            code="unsupported_value",
        )


async def count_tokens(state: ServerState, body: CountTokensRequest) -> dict[str, Any]:
    """`{"input_tokens": N}`: the length of the prompt `/v1/messages` would prefill for the same
    conversation (the chat template's rendering, prefill included), whatever the context."""
    check_supported(body)
    engine, _ = state.engine_for(body.model)
    chat = conversation(body)
    count = await prepare_async(
        lambda: engine.count_chat_tokens_async(
            chat.messages, chat_template_kwargs=chat.template_kwargs
        )
    )
    return TokenCount(input_tokens=count).dump()


async def start_message(
    state: ServerState, body: MessagesRequest, record: RequestRecord
) -> MessageRun:
    """Validate, prepare and admit one Messages request; raises `APIError` before any byte."""
    check_supported(body)
    engine, model = state.engine_for(body.model)
    record.model = model
    chat = conversation(body)
    options: dict[str, Any] = {}
    if body.top_k is not None:
        options["top_k"] = body.top_k
    if body.thinking is not None and body.thinking.type == "enabled":
        options["thinking_token_budget"] = body.thinking.budget_tokens
    try:
        prepared = await prepare_async(
            lambda: engine.prepare_chat_async(
                chat.messages,
                max_tokens=body.max_tokens,
                temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
                stop=body.stop_sequences,
                chat_template_kwargs=chat.template_kwargs,
                **options,
            )
        )
    except APIError as exc:
        if exc.param in _PARAMS:
            exc.param = _PARAMS[exc.param]
        raise
    record.prompt_tokens = len(prepared.prompt_tokens)
    active = await admit(engine, prepared)
    return MessageRun(model, body.max_tokens, len(prepared.prompt_tokens), active, record)


class MessageRun:
    """One admitted Messages request: its final `Message`, or (`stream.message_events`) its
    events. Whichever reads it closes the request when it ends, however it ends."""

    def __init__(
        self,
        model: str,
        max_tokens: int,
        prompt_tokens: int,
        active: ActiveRequest,
        record: RequestRecord,
    ) -> None:
        self.id = new_message_id()
        self.model = model
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.active = active
        self.record = record

    def stop_reason(self, final: GenerationOutput) -> StopReason:
        if final.finish_reason == "length":
            if final.completion_tokens < self.max_tokens:
                return "model_context_window_exceeded"
            return "max_tokens"
        return "stop_sequence" if final.stop_sequence is not None else "end_turn"

    def message(self, final: GenerationOutput) -> Message:
        content: list[OutputBlock] = []
        if final.reasoning:
            content.append(ThinkingBlock(thinking=final.reasoning))
        content.append(TextBlock(text=final.text))
        return Message(
            id=self.id,
            model=self.model,
            content=content,
            stop_reason=self.stop_reason(final),
            stop_sequence=final.stop_sequence,
            usage=MessageUsage.of(final),
        )

    async def final(self) -> dict[str, Any]:
        """Run to the end; the `Message` (a failed or aborted generation raises `APIError`)."""
        last = await run_to_end(self.active, self.record)
        raise_failure(last)
        return self.message(last).dump()
