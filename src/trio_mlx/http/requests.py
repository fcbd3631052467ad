"""Request bodies of the OpenAI chat and completions routes, as pydantic models, and what every
route's body shares (`SamplingFields`, the content parts, the field types below). The Responses
API's bodies are in `responses/requests`, the Anthropic ones in `anthropic/requests`.

Types and ranges that are plain facts about the field are checked here (a failure is a 400 whose
`param` names the field); values that depend on the model (token ids, the context) are checked by
the engine's `RequestPreparer`. Unknown fields are ignored, as the OpenAI API does. Fields that are
accepted but only take one value here (`n`, `best_of`) are validated, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator

from trio_mlx.http.errors import APIError
from trio_mlx.http.structured_output import ResponseFormat
from trio_mlx.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P

# Fields that are validated in code (for a clearer message than a type error) but whose accepted
# values the published schema states exactly, so that a client generated from it sends nothing
# this server refuses.
ONLY_ONE = WithJsonSchema({"anyOf": [{"const": 1}, {"type": "null"}], "default": 1})
ONLY_NULL = WithJsonSchema({"type": "null", "description": "Not supported: leave it out."})

# Empty stop strings are refused by `_stops_not_empty` (for its message); the schema says so too.
StopString = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]
StopField = Annotated[
    StopString | Annotated[list[StopString], Field(max_length=4)] | None,
    Field(description="Up to 4 strings; generation stops before any of them."),
]


def _integral(value: Any) -> Any:
    """A float with no fractional part (`2.0`, `1e3`) as the int it is. JSON Schema's `integer`
    is any number without a fractional part, so clients generated from the published schema may
    send one; anything else is left to the strict int check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_INTEGRAL = BeforeValidator(_integral)  # last in `Annotated`, so that it runs before the checks
#: Integer fields: an int, or a float with no fractional part.
Integer = Annotated[int, _INTEGRAL]
NonNegative = Annotated[int, Field(ge=0), _INTEGRAL]
Positive = Annotated[int, Field(ge=1), _INTEGRAL]
TopLogprobs = Annotated[int, Field(ge=0, le=20), _INTEGRAL]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What every generation route accepts besides its prompt and token limit."""

    model: str | None = Field(default=None, description="A name from GET /v1/models.")
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: StopField = None
    seed: Integer | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: NonNegative | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    #: SpecPrefill for this request (an approximate sparse prefill of a long prompt; None: the
    #: server's setting) and the fraction of the prompt it keeps
    specprefill: bool | None = None
    specprefill_keep_pct: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    logit_bias: Annotated[
        dict[
            Annotated[str, Field(pattern=r"^-?[0-9]+$")],
            Annotated[float, Field(ge=-100.0, le=100.0)],
        ]
        | None,
        # Keys are token ids; a negative one is refused as outside the vocabulary, and a key that
        # is not a number is refused too (pydantic's own schema would allow any other key).
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "propertyNames": {"pattern": "^[0-9]+$"},
                        "additionalProperties": {
                            "type": "number",
                            "minimum": -100.0,
                            "maximum": 100.0,
                        },
                    },
                    {"type": "null"},
                ],
                "default": None,
            }
        ),
    ] = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return value

    def sampling_options(self) -> dict[str, Any]:
        """The engine keyword options this request sets (absent ones keep engine defaults)."""
        options: dict[str, Any] = {
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": DEFAULT_TOP_P if self.top_p is None else self.top_p,
            "stop": self.stop,
            "seed": self.seed,
        }
        for name in (
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "specprefill",
            "specprefill_keep_pct",
        ):
            value = getattr(self, name)
            if value is not None:
                options[name] = value
        return options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _only_one_choice(n: int | None, name: str = "n") -> None:
    if n is not None and n != 1:
        raise APIError(
            400,
            f"{name} must be 1: this server generates one choice per request",
            param=name,
            code="unsupported_value",
        )


# ---- chat completions --------------------------------------------------------------------------


#: A media part's URL as the published schema states it where the part is media (the server
#: refuses an empty one, naming the part); the same field on a text part is ignored, so there the
#: schema leaves it a plain string.
MEDIA_URL_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "description": "A data URL (`data:image/png;base64,...`), an http(s) URL, or a local path "
    "under the server's --allowed-local-media-path",
}
MEDIA_SOURCE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "object", "properties": {"url": MEDIA_URL_SCHEMA}, "required": ["url"]},
        MEDIA_URL_SCHEMA,
    ]
}


class ImageURL(_Body):
    """The source of an `image_url` / `video_url` part (`detail` is accepted and ignored)."""

    url: str
    detail: str | None = None


#: Text parts, and the media parts with the field that holds their source. The media parts are
#: served on a vision-language model and refused by a text-only one (a 400 naming the part).
TEXT_PART_TYPES = ("text", "input_text", "output_text")
MEDIA_PART_FIELDS = {"image_url": "image_url", "input_image": "image_url", "video_url": "video_url"}
#: Part types a request may hold (`input_audio` parses but is refused: no audio models here).
SERVED_PART_TYPES = [*TEXT_PART_TYPES, "refusal", *MEDIA_PART_FIELDS]


def when_type(kind: str, then: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema condition of a tagged object (a content part, an input item, a block):
    `then` applies where its `type` is `kind`."""
    return {"if": {"properties": {"type": {"const": kind}}, "required": ["type"]}, "then": then}


def _part_type_is(*types: str) -> dict[str, Any]:
    return {"properties": {"type": {"enum": list(types)}}, "required": ["type"]}


def _content_part_schema(schema: dict[str, Any]) -> None:
    # Which field each part type needs, as the server checks it (chat.py, multimodal/parts.py).
    schema["allOf"] = [
        {
            "if": _part_type_is(*TEXT_PART_TYPES),
            "then": {"properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
        *(
            {
                "if": _part_type_is(kind),
                "then": {"properties": {field: MEDIA_SOURCE_SCHEMA}, "required": [field]},
            }
            for kind, field in MEDIA_PART_FIELDS.items()
        ),
    ]
    schema["description"] = (
        "Text (`text`; Responses' `input_text`, `output_text`), `refusal`, or media for a "
        'vision-language model: chat\'s `{"type": "image_url", "image_url": {"url"}}` and '
        '`{"type": "video_url", "video_url": {"url"}}`, Responses\' `{"type": "input_image", '
        '"image_url": "<url>"}` (each source an object with `url` or the URL itself; either '
        "route takes any of them). A text-only model refuses media parts with a 400 naming the "
        "part (`messages[1].content[0].image_url`)."
    )


class ContentPart(_Body):
    """A part of a message's content: text (`text`, `input_text`, `output_text`) or media."""

    # A text part without `text`, or a media part without its source, is refused where the
    # content is read (chat.py, multimodal/parts.py); the schema states it as conditions on `type`.
    model_config = ConfigDict(json_schema_extra=_content_part_schema)

    type: Annotated[
        Literal[
            "text",
            "input_text",
            "output_text",
            "image_url",
            "input_image",
            "input_audio",
            "video_url",
            "refusal",
        ],
        WithJsonSchema({"enum": SERVED_PART_TYPES}),
    ]
    text: str | None = None
    refusal: str | None = None
    # `image_url` (chat: an object with `url`; Responses' `input_image`: the URL itself) and
    # `video_url`: media for a vision-language model (a text model refuses them, naming them)
    image_url: ImageURL | str | None = None
    video_url: ImageURL | str | None = None


class ChatMessage(_Body):
    # Only assistant and tool messages may leave `content` out or null (chat.py refuses others).
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {"role": {"enum": ["system", "developer", "user"]}},
                "required": ["role"],
            },
            "then": {
                "properties": {"content": {"type": ["string", "array"]}},
                "required": ["content"],
            },
        }
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Checked in `http/tooling.py` (for its messages); the schema states the same.
    tool_calls: Annotated[
        list[dict[str, Any]] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "id": {"type": "string"},
                                "type": {"const": "function"},
                                "function": {
                                    "type": "object",
                                    "properties": {
                                        "name": {"type": "string", "minLength": 1},
                                        "arguments": {"type": "string"},
                                    },
                                    "required": ["name"],
                                },
                            },
                            "required": ["function"],
                        },
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


#: `tool_choice` naming one function (chat: under `function`; Responses: `name` itself).
NAMED_FUNCTION_CHOICE = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    # `top_logprobs` above 0 needs `logprobs: true` (refused in `check_supported`).
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                "required": ["top_logprobs"],
            },
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    n: Annotated[Integer | None, ONLY_ONE] = 1
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    tools: list[ChatTool] | None = None
    # Checked against `tools` in `http/tooling.py` (a named function must be one of them).
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | dict[str, Any] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    NAMED_FUNCTION_CHOICE,
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: NonNegative | None = None

    def check_supported(self) -> None:
        _only_one_choice(self.n)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")

    @property
    def completion_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# ---- completions -------------------------------------------------------------------------------

# A token id; a negative one is refused as outside the vocabulary (by the engine, which knows it).
TokenId = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0}), _INTEGRAL]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)
        ]
    )
    max_tokens: Positive | None = 16
    n: Annotated[Integer | None, ONLY_ONE] = 1
    best_of: Annotated[Integer | None, ONLY_ONE] = None
    echo: bool = False
    suffix: Annotated[str | None, ONLY_NULL] = None
    logprobs: TopLogprobs | None = None

    def check_supported(self) -> None:
        _only_one_choice(self.n)
        _only_one_choice(self.best_of, "best_of")
        if self.suffix:
            raise APIError(
                400,
                "suffix is not supported on this server",
                param="suffix",
                code="unsupported_value",
            )

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (a batch of several is a 400)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]  # type: ignore[arg-type]
        if len(prompt) != 1:
            raise APIError(
                400,
                "prompt must be a single prompt: this server does not batch",
                param="prompt",
                code="unsupported_value",
            )
        only = prompt[0]
        return only if isinstance(only, str) else list(only)  # type: ignore[arg-type]
