"""What a caller may ask the output to be: `OutputFormat`, a hashable value naming a grammar.

The value is what the grammar cache is keyed by (with the tokenizer): two requests with the same
schema share one compiled grammar. A JSON schema is held as compact JSON text, its keys in the
caller's order: the order of `properties` is the order the fields are generated in.
`param` is the request field that errors about this format name (`response_format` on chat,
`text.format` on Responses); it is not part of the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from trio_mlx.errors import InvalidRequest

FormatKind = Literal["json_schema", "json_object", "regex", "lark"]

#: The `param` errors name when the caller did not say which field the format came from.
DEFAULT_PARAM = "output_format"


@dataclass(frozen=True)
class OutputFormat:
    """A constraint on the text a request generates.

    - `json_schema`: a JSON value valid against `source` (the schema as compact JSON text);
      `strict` refuses a schema using keywords the grammar cannot enforce, where a non-strict
      one has them ignored;
    - `json_object`: any JSON object;
    - `regex`: text matching the regular expression `source` in full;
    - `lark`: text of the Lark grammar `source` (llguidance's dialect, rule `start`).

    Build one with the constructors (`OutputFormat.json_schema(schema)`, ...), not directly.
    """

    kind: FormatKind
    source: str = ""
    strict: bool = True
    param: str = field(default=DEFAULT_PARAM, compare=False)

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | bool, strict: bool = True, *, param: str = DEFAULT_PARAM
    ) -> OutputFormat:
        """A JSON value valid against `schema` (a JSON Schema object; `True` is any value).
        `InvalidRequest` (naming `param`) for a schema that is not a JSON object."""
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise InvalidRequest("a JSON schema must be a JSON object", param=param)
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the JSON schema is not JSON: {exc}", param=param) from exc
        return cls("json_schema", text, bool(strict), param)

    @classmethod
    def json_object(cls, *, param: str = DEFAULT_PARAM) -> OutputFormat:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object", "", True, param)

    @classmethod
    def regex(cls, pattern: str, *, param: str = DEFAULT_PARAM) -> OutputFormat:
        """Text matching `pattern` in full (Rust `regex` syntax, as llguidance reads it)."""
        if not isinstance(pattern, str):
            raise InvalidRequest("a regular expression must be a string", param=param)
        return cls("regex", pattern, True, param)

    @classmethod
    def lark(cls, grammar: str, *, param: str = DEFAULT_PARAM) -> OutputFormat:
        """Text of a Lark grammar (llguidance's dialect: its `start` rule)."""
        if not isinstance(grammar, str):
            raise InvalidRequest("a Lark grammar must be a string", param=param)
        return cls("lark", grammar, True, param)

    def naming(self, param: str) -> OutputFormat:
        """The same format, its errors naming `param`."""
        return replace(self, param=param)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema (`json_schema`; `{"type": "object"}` for `json_object`), else None."""
        if self.kind == "json_schema":
            value: dict[str, Any] = json.loads(self.source)
            return value
        if self.kind == "json_object":
            return {"type": "object"}
        return None
