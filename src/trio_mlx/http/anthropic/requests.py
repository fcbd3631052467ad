"""Request bodies of the Anthropic Messages routes (`POST /v1/messages`, `.../count_tokens`).

The shapes are Anthropic's: `system` as a string or text blocks, `messages` of `user` and
`assistant` turns whose `content` is a string or a list of content blocks. Types and ranges that
are plain facts about a field are checked here (a 400 naming the field); what depends on the
model (its context, its vocabulary) is checked by the engine.

Content blocks are one model with a `type` tag, so that the block types this server will serve
later (`image`, `document`, `tool_use`, `tool_result`) parse today and are refused where the
conversation is read (`conversation.py`) with a 400 naming the block, instead of a type error;
the published schema lists only what is served now. `thinking` and `redacted_thinking` blocks in
an assistant turn are what this server (and Anthropic) sends back; clients echo them in the next
request, and they are dropped there, as Anthropic drops earlier turns' thinking. `tools` and
`tool_choice` are accepted when they ask for nothing (no tools; `auto` or `none`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from trio_mlx.http.requests import NonNegative, Positive, _Body

#: Block types that parse but are refused until this server serves them (tool calling, images).
LATER_BLOCK_TYPES = ("image", "document", "tool_use", "tool_result", "search_result")
#: Blocks of the model's own reasoning, dropped from assistant turns (see the module docstring).
THINKING_BLOCK_TYPES = ("thinking", "redacted_thinking")


def _text_required(schema: dict[str, Any]) -> None:
    # A text block without `text` is refused where the content is read; the schema says so.
    schema["required"] = ["type", "text"]
    schema["properties"]["text"] = {"type": "string"}


class ContentBlock(_Body):
    """One block of a message's content. Only `text` blocks (with `text`) are served now."""

    model_config = ConfigDict(json_schema_extra=_text_required)

    type: Annotated[
        Literal[
            "text",
            "image",
            "document",
            "tool_use",
            "tool_result",
            "search_result",
            "thinking",
            "redacted_thinking",
        ],
        WithJsonSchema({"const": "text"}),
    ]
    text: str | None = None
    # Accepted and ignored: the prefix cache needs no breakpoints, it reuses any shared prefix.
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class SystemBlock(_Body):
    """A text block of the `system` prompt."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class MessageParam(_Body):
    """One turn of the conversation. A last `assistant` turn is a prefill: the answer continues
    its text."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolChoice(_Body):
    type: Annotated[
        Literal["auto", "any", "tool", "none"], WithJsonSchema({"enum": ["auto", "none"]})
    ]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    """`enabled` with a `budget_tokens` (thinking tokens at most, then the answer), `disabled`
    (the chat template's `enable_thinking=False`, for templates that take it), or `adaptive`
    (the model decides)."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"type": {"const": "enabled"}}, "required": ["type"]},
            "then": {
                "required": ["budget_tokens"],
                "properties": {"budget_tokens": {"type": "integer", "minimum": 1}},
            },
        }
    )

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Positive | None = None


class Metadata(_Body):
    user_id: str | None = None


NoTools = WithJsonSchema(
    {
        "anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
        "default": None,
        "description": "Not supported yet: leave it out or empty.",
    }
)
SystemField = str | list[SystemBlock] | None
StopSequence = Annotated[str, Field(min_length=1)]


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str | None = Field(
        default=None, description="A name from GET /v1/models; the served model when left out."
    )
    system: SystemField = None
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    tools: Annotated[list[dict[str, Any]] | None, NoTools] = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Positive
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: NonNegative | None = None
    stop_sequences: list[StopSequence] | None = None
    metadata: Metadata | None = None
    stream: bool = False
