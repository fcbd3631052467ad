"""Request bodies of the Anthropic Messages routes (`POST /v1/messages`, `.../count_tokens`).

The shapes are Anthropic's: `system` as a string or text blocks, `messages` of `user` and
`assistant` turns whose `content` is a string or a list of content blocks, `tools` as
`{name, description, input_schema}`, `tool_choice` as `{type: auto | any | tool | none, name,
disable_parallel_tool_use}`. Types and ranges that are plain facts about a field are checked
here (a 400 naming the field); what depends on the model (its context, its vocabulary, whether it
takes images) is checked by the engine.

Content blocks are one model with a `type` tag, so that every block type parses and is read (or
refused with a 400 naming the block) where the conversation is read (`conversation.py`), instead
of a type error. Their variable parts (`source`, `input`, `tool_result` content) are plain
objects here, checked there. The published schema states, type by type, what is served:
`text`, `tool_use` (assistant turns), `tool_result` (user turns), `thinking` and
`redacted_thinking` (assistant turns: what this server and Anthropic send back; a `thinking`
block is the turn's reasoning where the chat template renders it, else dropped), `document`
(user turns; text: a `text` source or a `content` source of text blocks), and `image` (user
turns; `source` base64 with a `media_type` of `IMAGE_MEDIA_TYPES`, or a `url`): served on a
vision-language model and refused by a text-only one with a 400 naming the block, as the OpenAI
routes' image parts are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from trio_mlx.http.requests import NonNegative, Positive, _Body, when_type

#: Block types that parse but are refused (search results).
LATER_BLOCK_TYPES = ("search_result",)
#: Blocks of the model's own reasoning, dropped from assistant turns (see the module docstring).
THINKING_BLOCK_TYPES = ("thinking", "redacted_thinking")
#: The block types each role's turns may hold, as the published schema lists them.
SERVED_BLOCK_TYPES = {
    "user": ["text", "image", "document", "tool_result"],
    "assistant": ["text", "tool_use", *THINKING_BLOCK_TYPES],
}
#: The media types of a base64 image source.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
#: Anthropic's rule for tool names.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,128}$"

_STRING_OR_NULL = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_OBJECT_OR_NULL = {"anyOf": [{"type": "object"}, {"type": "null"}]}
_TEXT_ITEM = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}


_NON_EMPTY = {"type": "string", "minLength": 1}
#: A document block's `source` as served: plain text, or content of text blocks.
_DOCUMENT_SOURCE = {
    "oneOf": [
        {
            "type": "object",
            "properties": {
                "type": {"const": "text"},
                "media_type": {"const": "text/plain"},
                "data": {"type": "string"},
            },
            "required": ["type", "data"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "content"},
                "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_ITEM}]},
            },
            "required": ["type", "content"],
        },
    ]
}
#: An image block's `source`, as `conversation.py` reads it.
_IMAGE_SOURCE = {
    "oneOf": [
        {
            "type": "object",
            "properties": {
                "type": {"const": "base64"},
                "media_type": {"enum": list(IMAGE_MEDIA_TYPES)},
                "data": _NON_EMPTY | {"contentEncoding": "base64"},
            },
            "required": ["type", "media_type", "data"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "url"},
                "url": _NON_EMPTY
                | {
                    "description": "An http(s) URL (or a data URL, or a local path under the "
                    "server's --allowed-local-media-path)"
                },
            },
            "required": ["type", "url"],
        },
    ]
}


_IMAGE_ITEM = {
    "type": "object",
    "properties": {"type": {"const": "image"}, "source": _IMAGE_SOURCE},
    "required": ["type", "source"],
}


def _block_schema(schema: dict[str, Any]) -> None:
    # Every field a block type reads, and which ones each type requires.
    schema["properties"] = {
        "type": {"enum": sorted({t for types in SERVED_BLOCK_TYPES.values() for t in types})},
        "text": _STRING_OR_NULL,
        "id": _STRING_OR_NULL,
        "name": _STRING_OR_NULL,
        "input": _OBJECT_OR_NULL,
        "tool_use_id": _STRING_OR_NULL,
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object"}},
                {"type": "null"},
            ]
        },
        "is_error": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        "source": _OBJECT_OR_NULL,
        "thinking": _STRING_OR_NULL,
        "signature": _STRING_OR_NULL,
        "title": _STRING_OR_NULL,
        "context": _STRING_OR_NULL,
        "cache_control": _OBJECT_OR_NULL,
        "citations": {"anyOf": [{"type": "array"}, {"type": "object"}, {"type": "null"}]},
    }
    schema["required"] = ["type"]
    schema["allOf"] = [
        when_type("text", {"properties": {"text": {"type": "string"}}, "required": ["text"]}),
        when_type(
            "tool_use",
            {
                "properties": {
                    "id": {"type": "string"},
                    "name": {"type": "string", "minLength": 1},
                    "input": {"type": "object"},
                },
                "required": ["id", "name", "input"],
            },
        ),
        when_type("image", {"properties": {"source": _IMAGE_SOURCE}, "required": ["source"]}),
        when_type(
            "document",
            {
                "properties": {
                    "source": _DOCUMENT_SOURCE,
                    "citations": {
                        "anyOf": [
                            {"type": "object", "properties": {"enabled": {"const": False}}},
                            {"type": "null"},
                        ]
                    },
                },
                "required": ["source"],
            },
        ),
        when_type(
            "tool_result",
            {
                "properties": {
                    "tool_use_id": {"type": "string"},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"anyOf": [_TEXT_ITEM, _IMAGE_ITEM]}},
                            {"type": "null"},
                        ]
                    },
                },
                "required": ["tool_use_id"],
            },
        ),
    ]
    schema["description"] = (
        "`text`; `tool_use` (`id`, `name`, `input`) in assistant turns; `tool_result` "
        "(`tool_use_id`, `content` a string or text and image blocks, `is_error`) in user turns; "
        "`thinking` "
        "and `redacted_thinking` in assistant turns; `document` blocks of text in user turns "
        '(`source` `{"type": "text", "media_type": "text/plain", "data"}` or `{"type": '
        '"content", "content"}` of text blocks; `title`, `context`); `image` blocks in user turns '
        '(`{"type": "image", "source": {"type": "base64", "media_type", "data"}}` or '
        '`{"source": {"type": "url", "url"}}`), served on a vision-language model and refused '
        "by a text-only one with a 400 naming the block."
    )


class ContentBlock(_Body):
    """One block of a message's content (see the module docstring; `conversation.py` reads
    them)."""

    model_config = ConfigDict(json_schema_extra=_block_schema)

    type: Literal[
        "text",
        "image",
        "document",
        "tool_use",
        "tool_result",
        "search_result",
        "thinking",
        "redacted_thinking",
    ]
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result: a string, or blocks (text and image ones are served)
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"};
    # document: {"type": "text", "media_type": "text/plain", "data"} or {"type": "content", ...}
    source: dict[str, Any] | None = None
    # document
    title: str | None = None
    context: str | None = None
    # thinking: the reasoning an earlier answer gave (its signature is not checked)
    thinking: str | None = None
    signature: str | None = None
    # Accepted and ignored: the prefix cache needs no breakpoints, it reuses any shared prefix.
    cache_control: dict[str, Any] | None = None
    # a text block's citations (a list, ignored); a document's `{"enabled"}` (not produced)
    citations: list[Any] | dict[str, Any] | None = None


def _role_blocks(schema: dict[str, Any]) -> None:
    schema["allOf"] = [
        {
            "if": {"properties": {"role": {"const": role}}, "required": ["role"]},
            "then": {
                "properties": {
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {
                                "type": "array",
                                "items": {"properties": {"type": {"enum": types}}},
                            },
                        ]
                    }
                }
            },
        }
        for role, types in SERVED_BLOCK_TYPES.items()
    ]


class SystemBlock(_Body):
    """A text block of the `system` prompt."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class MessageParam(_Body):
    """One turn of the conversation. A last `assistant` turn is a prefill: the answer continues
    its text."""

    model_config = ConfigDict(json_schema_extra=_role_blocks)

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


def _client_tool_schema(schema: dict[str, Any]) -> None:
    # What is served: a client tool whose `input_schema` is an object schema.
    schema["properties"]["input_schema"] = {
        "type": "object",
        "properties": {"type": {"const": "object"}},
        "required": ["type"],
    }
    schema["properties"]["type"] = {"anyOf": [{"const": "custom"}, {"type": "null"}]}
    schema["required"] = ["name", "input_schema"]


class ToolParam(_Body):
    """A client tool: its name, what it does, and the JSON Schema of its `input` (an object).
    Anthropic's server tools (`web_search_...`, `code_execution_...`) and Anthropic-defined
    client tools (`bash_...`, `text_editor_...`, `computer_...`), whose schema Claude knows and
    this server does not, are refused in `tools.py` (a 400 naming the tool's `type`), which also
    checks `input_schema`: parsed loosely here so that the refusal names what is wrong."""

    model_config = ConfigDict(json_schema_extra=_client_tool_schema)

    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Body):
    """`auto` (the model decides), `any` (some tool must be called), `tool` (the tool `name`
    must be called), `none` (no tool is offered). `disable_parallel_tool_use`: one call at most
    (with `any` or `tool`: exactly one)."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"type": {"const": "tool"}}, "required": ["type"]},
            "then": {"properties": {"name": {"type": "string"}}, "required": ["name"]},
        }
    )

    type: Literal["auto", "any", "tool", "none"]
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


SystemField = str | list[SystemBlock] | None
StopSequence = Annotated[str, Field(min_length=1)]


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str | None = Field(
        default=None, description="A name from GET /v1/models; the served model when left out."
    )
    system: SystemField = None
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class JSONOutputFormat(_Body):
    """Structured output: the answer's text is JSON valid against `schema` (generated under
    its grammar, as the OpenAI routes' `response_format`)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_Body):
    """`format`: structured output; `effort` is accepted and has no effect."""

    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Positive
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: NonNegative | None = None
    stop_sequences: list[StopSequence] | None = None
    metadata: Metadata | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    #: The structured-outputs beta's spelling of `output_config.format`.
    output_format: JSONOutputFormat | None = None
    #: The message-threads beta (the server holds the conversation between turns): not held
    #: here, so a request with a `thread` is refused (`thread_unsupported_request`), and the
    #: SDK's tool runner sends the whole conversation instead.
    thread: Any = Field(
        default=None,
        json_schema_extra={
            "type": "null",
            "description": "Message threads are not served: send the whole conversation.",
        },
    )
    #: The MCP connector beta (the server calls remote MCP servers' tools): not served, so a
    #: request that lists any is refused rather than answered without their tools.
    mcp_servers: list[Any] | None = Field(
        default=None,
        json_schema_extra={
            "anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}],
            "description": "MCP servers are not connected: give their tools as client tools.",
        },
    )
