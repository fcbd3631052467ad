"""Structured output on the HTTP routes: OpenAI's `response_format` (chat completions) and
`text.format` (Responses), as request models and as the engine's `OutputFormat`.

- `{"type": "text"}` (or nothing): unconstrained;
- `{"type": "json_object"}`: any JSON object;
- `{"type": "json_schema", ...}`: JSON valid against the schema. Chat nests it
  (`"json_schema": {"name", "schema", "strict"}`), Responses does not (`"name", "schema",
  "strict"` beside `type`). `strict: true` refuses a schema with keywords that cannot be
  enforced; otherwise they are ignored.

A format that is missing its schema is a 400 here; one the grammar cannot compile is a 400 from
request preparation. Both name the field the client sent (`response_format` or `text.format`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trio_mlx.http.errors import APIError
from trio_mlx.structured.formats import OutputFormat

FormatType = Literal["text", "json_object", "json_schema"]
SCHEMA_NAME = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
SchemaObject = Annotated[
    dict[str, Any],
    Field(description="A JSON Schema; the output is generated to be valid against it."),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


def _needs_when_json_schema(field: str) -> dict[str, Any]:
    """The published schema's statement that a `json_schema` format needs `field` (refused
    here when it is missing), so that a client generated from the document sends it."""
    return {
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": [field], "properties": {field: {"type": "object"}}},
    }


class JSONSchemaFormat(_Body):
    """Chat's `response_format.json_schema`."""

    name: SCHEMA_NAME
    description: str | None = None
    schema_: SchemaObject = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """Chat completions' `response_format`."""

    model_config = ConfigDict(json_schema_extra=_needs_when_json_schema("json_schema"))

    type: FormatType
    json_schema: JSONSchemaFormat | None = None


class ResponseTextFormat(_Body):
    """The Responses API's `text.format`."""

    model_config = ConfigDict(json_schema_extra=_needs_when_json_schema("schema"))

    type: FormatType = "text"
    name: SCHEMA_NAME | None = None
    description: str | None = None
    schema_: SchemaObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


def chat_output_format(fmt: ResponseFormat | None) -> OutputFormat | None:
    """The output format a chat request's `response_format` asks for (None: plain text)."""
    param = "response_format"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputFormat.json_object(param=param)
    spec = fmt.json_schema
    if spec is None:
        raise APIError(
            400,
            'response_format of type "json_schema" needs json_schema',
            param=param,
            code="missing_required_parameter",
        )
    return OutputFormat.json_schema(spec.schema_, strict=bool(spec.strict), param=param)


def responses_output_format(fmt: ResponseTextFormat | None) -> OutputFormat | None:
    """The output format a Responses request's `text.format` asks for (None: plain text)."""
    param = "text.format"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputFormat.json_object(param=param)
    if fmt.schema_ is None:
        raise APIError(
            400,
            'text.format of type "json_schema" needs schema',
            param=param,
            code="missing_required_parameter",
        )
    return OutputFormat.json_schema(fmt.schema_, strict=bool(fmt.strict), param=param)
