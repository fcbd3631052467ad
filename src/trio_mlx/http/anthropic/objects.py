"""Response bodies, stream events and errors of the Anthropic Messages routes, as pydantic models.

They are the single description of what these routes send: route code builds them and
`openapi.py` documents them. Every field is always present (`stop_reason: null` included), as
Anthropic sends them.

Usage follows Anthropic's accounting: the prompt is `input_tokens` (prefilled) plus
`cache_read_input_tokens` (restored from the prefix KV cache) plus `cache_creation_input_tokens`
(always 0: the prefix cache stores prefixes as a side effect, nothing is billed for it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from trio_mlx.types import GenerationOutput

StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]
ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]


class AnthropicObject(BaseModel):
    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class TextBlock(AnthropicObject):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(AnthropicObject):
    """The model's reasoning (a model whose tokenizer has thinking tags). `signature` is empty:
    nothing here is signed, and a thinking block sent back is dropped, not verified."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(AnthropicObject):
    """A call of one of the request's tools: its id (`toolu_...`, what the `tool_result` that
    answers it names), the tool's name, and its input (an object)."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutputBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]


class MessageUsage(AnthropicObject):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, final: GenerationOutput) -> MessageUsage:
        return cls(
            input_tokens=final.prompt_tokens - final.cached_tokens,
            output_tokens=final.completion_tokens,
            cache_read_input_tokens=final.cached_tokens,
        )


class Message(AnthropicObject):
    """A Messages API answer. `stop_reason` is null only in the `message_start` event."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(AnthropicObject):
    input_tokens: int


# ---- stream events -------------------------------------------------------------------------


class MessageStartEvent(AnthropicObject):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(AnthropicObject):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class PingEvent(AnthropicObject):
    type: Literal["ping"] = "ping"


class TextDelta(AnthropicObject):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(AnthropicObject):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(AnthropicObject):
    """The next piece of a `tool_use` block's input, as JSON text: the pieces of one block,
    joined, are its whole `input`."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(AnthropicObject):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStopEvent(AnthropicObject):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(AnthropicObject):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(AnthropicObject):
    """The end of the answer: why it stopped, and the final usage (cumulative, every count)."""

    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessageUsage


class MessageStopEvent(AnthropicObject):
    type: Literal["message_stop"] = "message_stop"


class ErrorDetails(AnthropicObject):
    """What an Anthropic client acts on beyond the error's type (`errors.DETAILED_CODES`)."""

    error_code: str


class AnthropicErrorObject(AnthropicObject):
    type: ErrorType
    message: str
    #: only where the refusal has a code Anthropic's clients act on
    details: ErrorDetails | None = None


class AnthropicError(AnthropicObject):
    """Every error of these routes, as a response body and as the `error` event of a stream
    that fails after it began. `error.details` and `request_id` are left out where there are
    none (Anthropic's errors leave them out too)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorObject
    request_id: str | None = None

    def dump(self) -> dict[str, Any]:
        out = super().dump()
        if self.error.details is None:
            del out["error"]["details"]
        if self.request_id is None:
            del out["request_id"]
        return out


STREAM_EVENTS: tuple[type[AnthropicObject], ...] = (
    MessageStartEvent,
    ContentBlockStartEvent,
    PingEvent,
    ContentBlockDeltaEvent,
    ContentBlockStopEvent,
    MessageDeltaEvent,
    MessageStopEvent,
    AnthropicError,
)
