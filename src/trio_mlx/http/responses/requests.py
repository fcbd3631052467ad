"""Request bodies of the OpenAI Responses API (POST /v1/responses and a `response.create`
message on its WebSocket), as pydantic models.

The same rules as the other routes' bodies (`requests`): types and ranges that are plain facts
about a field are checked here (a 400 whose `param` names the field), unknown fields are
ignored, and what depends on other fields is refused by `check_supported` rather than ignored.
Which fields each input item needs is checked where the items become a conversation
(`conversation.input_messages`); `previous_response_id` and `conversation` are looked up where
the prompt is built (`prompt.ResponsePrompt`, in `store` and `http/conversations/turn.py`).
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.json_schema import SkipJsonSchema

from trio_mlx.http.errors import APIError
from trio_mlx.http.requests import (
    ContentPart,
    Positive,
    SamplingFields,
    TopLogprobs,
    _Body,
    when_type,
)
from trio_mlx.http.structured_output import ResponseTextFormat


def _input_item_schema(schema: dict[str, Any]) -> None:
    # Which fields each item type has and needs, as `InputItem` reads them and
    # `conversation.input_messages` checks them. `content` is a message's (a string or content
    # parts) or a reasoning item's (`reasoning_text` parts), `output` a function call output's:
    # their generated schemas move to their types' conditions (other types do not read them).
    def without_null(name: str) -> dict[str, Any]:
        shapes = schema["properties"][name]["anyOf"]
        return copy.deepcopy({"anyOf": [shape for shape in shapes if shape != {"type": "null"}]})

    message_content, call_output = without_null("content"), without_null("output")
    schema["properties"]["content"] = {
        "description": "A message's content: text or content parts; a reasoning item's: "
        "`reasoning_text` parts. Not read on other items."
    }
    schema["properties"]["output"] = {
        "description": "A function call output's: text or content parts. Not read on other items."
    }
    reasoning_part = {
        "type": "object",
        "properties": {"type": {"const": "reasoning_text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    schema["allOf"] = [
        when_type(
            "function_call",
            {
                "properties": {
                    "call_id": {"type": "string"},
                    "name": {"type": "string", "minLength": 1},
                    "arguments": {"type": "string"},
                },
                "required": ["call_id", "name", "arguments"],
            },
        ),
        when_type(
            "function_call_output",
            {
                "properties": {"call_id": {"type": "string"}, "output": call_output},
                "required": ["call_id", "output"],
            },
        ),
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
                    "content": message_content,
                },
                "required": ["role", "content"],
            },
        },
        when_type(
            "reasoning",
            {
                "properties": {
                    "content": {
                        "anyOf": [{"type": "array", "items": reasoning_part}, {"type": "null"}]
                    }
                }
            },
        ),
    ]


class InputItem(_Body):
    """An item of `input`: a message (`type` "message" or left out: `role` and `content`), a
    call the assistant made earlier (`function_call`: `call_id`, `name`, `arguments`), its
    result (`function_call_output`: `call_id`, `output`), or earlier reasoning (`reasoning`:
    `content` of `reasoning_text` parts). Which fields each needs is checked where the items
    become a conversation (`conversation.input_messages`); the schema states it."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _input_item_schema(schema))

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    # A reasoning item: its parts (`content`, read by `reasoning`), a summary and an encrypted
    # form (another server's; neither is read).
    summary: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    reasoning_parts: SkipJsonSchema[Any] = Field(default=None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _fields_of_the_type(cls, data: Any) -> Any:
        """`content` and `output` as the item's type has them: a reasoning item's `content` is
        `reasoning_text` parts (read apart), a function call's and its output's `content` and
        any other item's `output` are no fields of theirs (ignored, as unknown fields are)."""
        if not isinstance(data, dict):
            return data
        kind = data.get("type", "message")
        data = dict(data)
        if kind == "reasoning" and "content" in data:
            data["reasoning_parts"] = data.pop("content")
        elif kind in ("function_call", "function_call_output"):
            data.pop("content", None)
        if kind != "function_call_output":
            data.pop("output", None)
        return data

    def reasoning(self, field: str) -> str:
        """The text of a reasoning item's `reasoning_text` parts (`field` names the item in
        errors: `input[3]`)."""
        parts = self.reasoning_parts
        if parts is None:
            return ""
        if not isinstance(parts, list):
            raise APIError(
                400, "a reasoning item's content is a list of parts", param=f"{field}.content"
            )
        texts = []
        for j, part in enumerate(parts):
            if not (
                isinstance(part, dict)
                and part.get("type") == "reasoning_text"
                and isinstance(part.get("text"), str)
            ):
                raise APIError(
                    400,
                    "a reasoning item's content parts are "
                    '{"type": "reasoning_text", "text": "..."}',
                    param=f"{field}.content[{j}]",
                )
            texts.append(part["text"])
        return "\n".join(texts)


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


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | dict[str, Any] | None,
    WithJsonSchema(
        {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
                    "required": ["type", "name"],
                },
                {"type": "null"},
            ]
        }
    ),
]


def _chat_tools(tools: list[ResponseTool] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape (`{"type": "function", "function": {...}}`)."""
    if not tools:
        return None
    return [
        {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
        for tool in tools
    ]


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


class ConversationParam(_Body):
    """`conversation` as an object: `{"id": "conv_..."}`."""

    id: str


ConversationField = Annotated[
    str | ConversationParam | None,
    Field(
        description="The conversation (`/v1/conversations`) this response belongs to: its items "
        "come before `input`, and the request's input items and the response's output items are "
        "appended to it once the response ends `completed` or `incomplete`. Its id, or "
        '`{"id": ...}`; not with `previous_response_id`.'
    ),
]

#: `conversation` and `previous_response_id` are mutually exclusive (both non-null: a 400).
_ONE_OF_CONVERSATION_OR_PREVIOUS: dict[str, Any] = {
    "not": {
        "required": ["conversation", "previous_response_id"],
        "properties": {
            "conversation": {"not": {"type": "null"}},
            "previous_response_id": {"not": {"type": "null"}},
        },
    }
}


def conversation_id_of(conversation: str | ConversationParam | None) -> str | None:
    return conversation.id if isinstance(conversation, ConversationParam) else conversation


def check_one_continuation(body: ResponsesRequest | InputTokensRequest) -> None:
    """OpenAI's 400 for `conversation` with `previous_response_id`."""
    if body.conversation is not None and body.previous_response_id is not None:
        raise APIError(
            400,
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            param="conversation",
            code="mutually_exclusive_parameters",
        )


class ResponsesRequest(SamplingFields):
    """POST /v1/responses (and a `response.create` message on its WebSocket)."""

    # `top_logprobs` above 0 needs the logprobs included, `background` needs `store` (both
    # refused in `check_supported`).
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {
                        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                        "required": ["top_logprobs"],
                    },
                    "then": {
                        "properties": {
                            "include": {
                                "type": "array",
                                "contains": {"const": OUTPUT_TEXT_LOGPROBS},
                            }
                        },
                        "required": ["include"],
                    },
                },
                {
                    "if": {
                        "properties": {"background": {"const": True}},
                        "required": ["background"],
                    },
                    "then": {"properties": {"store": {"not": {"const": False}}}},
                },
                _ONE_OF_CONVERSATION_OR_PREVIOUS,
            ]
        }
    )

    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    previous_response_id: Annotated[
        str | None,
        Field(
            description="Continue the conversation of this response: its input and output "
            "items come before `input` (its `instructions` do not carry over). A response "
            "stored on this server (`store`), or on a WebSocket the connection's most recent one."
        ),
    ] = None
    conversation: ConversationField = None
    store: Annotated[
        bool | None,
        Field(
            description="Keep the response when it ends (completed or incomplete) for "
            "`previous_response_id`, `GET /v1/responses/{id}` and its input items; default true."
        ),
    ] = None
    background: Annotated[
        bool | None,
        Field(
            description="Run the response in the background: `POST` answers at once (status "
            "`queued`, or the event stream with `stream`), `GET /v1/responses/{id}` shows it "
            "`in_progress` then ended, `POST /v1/responses/{id}/cancel` cancels it. Needs "
            "`store` (not false)."
        ),
    ] = None
    truncation: Annotated[
        Literal["auto", "disabled"] | None,
        Field(
            description="`auto`: a conversation longer than the context loses its oldest input "
            "items until it fits; `disabled` (default): it is refused with a 400."
        ),
    ] = None
    metadata: dict[str, str] | None = None
    text: ResponseText | None = None
    tools: list[ResponseTool] | None = None
    # Checked against `tools` in `http/tooling.py` (a named function must be one of them).
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    include: list[Includable] | None = None
    top_logprobs: TopLogprobs | None = None

    @property
    def logprobs(self) -> bool:
        """Whether the output text's logprobs are included."""
        return OUTPUT_TEXT_LOGPROBS in (self.include or ())

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return _chat_tools(self.tools)

    @property
    def stored(self) -> bool:
        """Whether the response is kept when it ends (`store`, true unless false)."""
        return self.store is not False

    @property
    def conversation_id(self) -> str | None:
        return conversation_id_of(self.conversation)

    def check_supported(self) -> None:
        check_one_continuation(self)
        if self.background and not self.stored:
            raise APIError(
                400,
                "background mode needs the response stored: store must not be false",
                param="background",
            )
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                400,
                f"top_logprobs needs include to contain {OUTPUT_TEXT_LOGPROBS!r}",
                param="top_logprobs",
            )


class InputTokensRequest(_Body):
    """POST /v1/responses/input_tokens: the prompt fields of a Responses request, whose prompt
    is counted as `POST /v1/responses` would prefill it (`input`, `instructions`,
    `previous_response_id` or `conversation` needed)."""

    # `input`, non-empty `instructions`, `previous_response_id` or `conversation` (refused in
    # `check_supported`).
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["input"], "properties": {"input": {"not": {"type": "null"}}}},
                {
                    "required": ["instructions"],
                    "properties": {"instructions": {"type": "string", "minLength": 1}},
                },
                {
                    "required": ["previous_response_id"],
                    "properties": {"previous_response_id": {"type": "string", "minLength": 1}},
                },
                {
                    "required": ["conversation"],
                    "properties": {"conversation": {"not": {"type": "null"}}},
                },
            ],
            "allOf": [_ONE_OF_CONVERSATION_OR_PREVIOUS],
        }
    )

    model: str | None = Field(default=None, description="A name from GET /v1/models.")
    input: str | Annotated[list[InputItem], Field(min_length=1)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = Field(
        default=None, description="Count the conversation continued from this stored response."
    )
    conversation: ConversationField = None
    tools: list[ResponseTool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return _chat_tools(self.tools)

    @property
    def conversation_id(self) -> str | None:
        return conversation_id_of(self.conversation)

    def check_supported(self) -> None:
        check_one_continuation(self)
        if (
            self.input is None
            and not self.instructions
            and not self.previous_response_id
            and self.conversation is None
        ):
            raise APIError(
                400,
                "input or instructions is needed: there is no prompt to count",
                param="input",
                code="missing_required_parameter",
            )
