"""Request bodies of the OpenAI Responses API (POST /v1/responses and a `response.create`
message on its WebSocket), as pydantic models.

The same rules as the other routes' bodies (`requests`): types and ranges that are plain facts
about a field are checked here (a 400 whose `param` names the field), unknown fields are
ignored, and a field accepted with one value only (`previous_response_id`: this server stores no
responses) is refused by `check_supported` rather than ignored. Which fields each input item
needs is checked where the items become a conversation (`responses.input_messages`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from trio_mlx.http.errors import APIError
from trio_mlx.http.requests import (
    ONLY_NULL,
    ContentPart,
    Positive,
    SamplingFields,
    TopLogprobs,
    _Body,
)
from trio_mlx.http.structured_output import ResponseTextFormat


class InputItem(_Body):
    """An item of `input`: a message (`type` "message" or left out: `role` and `content`), a
    call the assistant made earlier (`function_call`: `call_id`, `name`, `arguments`), or its
    result (`function_call_output`: `call_id`, `output`). Which fields each needs is checked
    where the items become a conversation (`responses.input_messages`); the schema states it."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {
                        "properties": {"type": {"const": "function_call"}},
                        "required": ["type"],
                    },
                    "then": {
                        "properties": {
                            "call_id": {"type": "string"},
                            "name": {"type": "string", "minLength": 1},
                            "arguments": {"type": "string"},
                        },
                        "required": ["call_id", "name", "arguments"],
                    },
                },
                {
                    "if": {
                        "properties": {"type": {"const": "function_call_output"}},
                        "required": ["type"],
                    },
                    "then": {
                        "properties": {
                            "call_id": {"type": "string"},
                            "output": {"type": ["string", "array"]},
                        },
                        "required": ["call_id", "output"],
                    },
                },
                {
                    "if": {
                        "anyOf": [
                            {"not": {"required": ["type"]}},
                            {"properties": {"type": {"const": "message"}}},
                        ]
                    },
                    "then": {
                        "properties": {
                            "role": {"enum": ["system", "developer", "user", "assistant"]},
                            "content": {"type": ["string", "array"]},
                        },
                        "required": ["role", "content"],
                    },
                },
            ]
        }
    )

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class ResponseTool(_Body):
    """A Responses tool: a function (its fields beside `type`, not under `function`). The
    built-in tools (web search, file search, computer use, ...) are not served here."""

    type: Annotated[Literal["function"], WithJsonSchema({"const": "function"})]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseText(_Body):
    format: ResponseTextFormat | None = None


#: What `include` may ask for. Only the text's logprobs are ever added here: the others are
#: about items this server does not make (built-in tools' calls, reasoning's encrypted content)
#: or stores (input images), so there is nothing of them to include.
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"
Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class ResponsesRequest(SamplingFields):
    """POST /v1/responses (and a `response.create` message on its WebSocket)."""

    # `top_logprobs` above 0 needs the logprobs included (refused in `check_supported`).
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                "required": ["top_logprobs"],
            },
            "then": {
                "properties": {
                    "include": {"type": "array", "contains": {"const": OUTPUT_TEXT_LOGPROBS}}
                },
                "required": ["include"],
            },
        }
    )

    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    previous_response_id: Annotated[str | None, ONLY_NULL] = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    text: ResponseText | None = None
    tools: list[ResponseTool] | None = None
    # Checked against `tools` in `http/tooling.py` (a named function must be one of them).
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | dict[str, Any] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": "function"},
                            "name": {"type": "string"},
                        },
                        "required": ["type", "name"],
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    parallel_tool_calls: bool | None = None
    include: list[Includable] | None = None
    top_logprobs: TopLogprobs | None = None

    @property
    def logprobs(self) -> bool:
        """Whether the output text's logprobs are included."""
        return OUTPUT_TEXT_LOGPROBS in (self.include or ())

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat shape (`{"type": "function", "function": {...}}`)."""
        if not self.tools:
            return None
        return [
            {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
            for tool in self.tools
        ]

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise APIError(
                400,
                "previous_response_id is not supported: this server does not "
                "store responses; send the conversation as input items",
                param="previous_response_id",
                code="unsupported_value",
            )
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                400,
                f"top_logprobs needs include to contain {OUTPUT_TEXT_LOGPROBS!r}",
                param="top_logprobs",
            )
