"""Response bodies and stream events of the OpenAI routes, as pydantic models.

They are the single description of what the server sends: route code builds them, and
`openapi.py` documents them. Optional fields left unset are left out of the JSON.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from trio_mlx.types import GenerationOutput


class _Out(BaseModel):
    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    def dump(self) -> dict[str, Any]:  # param and code are always present, null when unset
        return self.model_dump(mode="json")


class ErrorResponse(_Out):
    error: ErrorDetail


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class Usage(_Out):
    """Token counts; `prompt_tokens_details.cached_tokens` are prompt tokens served from the
    prefix KV cache (not prefilled again)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, final: GenerationOutput) -> Usage:
        return cls(
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            total_tokens=final.prompt_tokens + final.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=final.cached_tokens),
        )


# ---- logprobs ----------------------------------------------------------------------------------


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Out):
    content: list[TokenLogprobOut] | None = None


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# ---- chat --------------------------------------------------------------------------------------


class FunctionCall(_Out):
    name: str
    arguments: str


class MessageToolCall(_Out):
    """A call the assistant makes (`message.tool_calls[]`); `arguments` is JSON text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[MessageToolCall] | None = None

    def dump(self) -> dict[str, Any]:  # content is always present (null only when absent)
        out = super().dump()
        out.setdefault("content", None)
        return out


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage

    def dump(self) -> dict[str, Any]:  # a message's content is always present (null with calls)
        out = super().dump()
        for choice in out["choices"]:
            choice["message"].setdefault("content", None)
        return out


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    """A piece of a streamed call: the first carries `index`, `id`, `type` and the name (with
    empty `arguments`); later ones the same `index` and the next piece of `arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- completions -------------------------------------------------------------------------------


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None

    def dump(self) -> dict[str, Any]:  # OpenAI sends both keys on every choice, null or not
        out = super().dump()
        for choice in out["choices"]:
            choice.setdefault("logprobs", None)
            choice.setdefault("finish_reason", None)
        return out


# ---- responses ---------------------------------------------------------------------------------


class OutputText(_Out):
    """A message's text. With `include: ["message.output_text.logprobs"]`, `logprobs` holds each
    of its tokens (`token`, `logprob`, `bytes`, and `top_logprobs` alternatives)."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprobOut] | None = None


class OutputMessage(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(_Out):
    """A call the model made (an output item; sent back later as an input item with its
    `call_id` and then a `function_call_output`)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Out):
    """The model's reasoning (a model whose tokenizer has thinking tags), before its answer.
    `summary` is empty: the reasoning is given whole, in `content`."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(_Out):
    cached_tokens: int = 0


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens", "content_filter"]


class ConversationRef(_Out):
    """A response's `conversation`: the id of the conversation it belongs to."""

    id: str


class ResponseObject(_Out):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputItem]
    #: Whether it runs in the background (`background`: retrieved and cancelled by its id).
    background: bool = False
    #: The response this one continued, and whether it is kept when it ends (`store`).
    previous_response_id: str | None = None
    #: The conversation it continued, to which its input and output items are appended when it
    #: ends (`conversation`).
    conversation: ConversationRef | None = None
    store: bool = True
    truncation: Literal["auto", "disabled"] = "disabled"
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ErrorDetail | None = None
    usage: ResponseUsage | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)
    output_text: str | None = None
    top_logprobs: int | None = None


class TextTopLogprob(_Out):
    token: str
    logprob: float


class TextLogprob(_Out):
    """A token of a `response.output_text.delta` / `.done` event's text (the stream events'
    shape: no `bytes`, as the API's events have none)."""

    token: str
    logprob: float
    top_logprobs: list[TextTopLogprob] = Field(default_factory=list)

    @classmethod
    def of(cls, item: TokenLogprobOut) -> TextLogprob:
        return cls(
            token=item.token,
            logprob=item.logprob,
            top_logprobs=[
                TextTopLogprob(token=top.token, logprob=top.logprob) for top in item.top_logprobs
            ],
        )


class ResponseDeleted(_Out):
    """`DELETE /v1/responses/{id}`: the response is no longer stored."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class ResponseItemList(_Out):
    """`GET /v1/responses/{id}/input_items`: a page of the conversation's input items (in the
    shapes of the input items they were, each with an `id`), the ids of its first and last
    item (null on an empty page), and whether more follow (the next page: `after=last_id`)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool

    def dump(self) -> dict[str, Any]:  # first_id and last_id are always present
        return self.model_dump(mode="json")


class ConversationObject(_Out):
    """A conversation (`/v1/conversations`): its items are listed apart
    (`/v1/conversations/{id}/items`)."""

    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)

    def dump(self) -> dict[str, Any]:  # metadata is always present
        return self.model_dump(mode="json")


class ConversationDeleted(_Out):
    """`DELETE /v1/conversations/{id}`: the conversation and its items are gone."""

    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: Literal[True] = True


class InputTokenCount(_Out):
    """`POST /v1/responses/input_tokens`: the prompt's length in tokens."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class ResponseStreamEvent(_Out):
    """One event of a streamed response (SSE `event:`/`data:` or one WebSocket message).
    `type` is `response.created`, `response.in_progress`, `response.output_item.added`,
    `response.content_part.added`, `response.output_text.delta`, `response.output_text.done`,
    `response.content_part.done`, `response.output_item.done` (for a function call:
    `response.output_item.added`, `response.function_call_arguments.delta`,
    `response.function_call_arguments.done`, `response.output_item.done`; for reasoning:
    `response.output_item.added`, `response.content_part.added` (a `reasoning_text` part),
    `response.reasoning_text.delta`, `response.reasoning_text.done`,
    `response.content_part.done`, `response.output_item.done`), then
    `response.completed`, `response.incomplete` or `response.failed`; or `error`."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputItem | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    name: str | None = None
    arguments: str | None = None
    #: On `response.output_text.delta` (the delta's tokens) and `.done` (the text's): empty
    #: unless the request included `message.output_text.logprobs`.
    logprobs: list[TextLogprob] | None = None


# ---- models and operations ---------------------------------------------------------------------


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trio-mlx"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(_Out):
    status: Literal["ok", "loading", "draining", "dead"]
    model: str | None = None
    detail: str | None = None
