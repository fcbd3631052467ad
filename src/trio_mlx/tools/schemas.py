"""The tools a request offers, as the parsers need them: their names (a call by a name the request
did not offer is not a call, for formats with no markup to tell a call from a JSON answer) and
each parameter's JSON Schema type (formats that write arguments as text, as Qwen3-Coder's and
GLM's, give every value as a string; the schema says which are numbers, booleans or objects)."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any


class ToolSchemas:
    """Function tools in OpenAI's shape (`{"type": "function", "function": {...}}`, or the
    function object itself, as the Responses API sends it)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self._parameters: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function", tool)
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                parameters = function.get("parameters")
                self._parameters[function["name"]] = (
                    parameters if isinstance(parameters, Mapping) else {}
                )

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._parameters)

    def accepts(self, name: str) -> bool:
        """Whether `name` may be a call: one of the tools offered (any name when none is known)."""
        return not self._parameters or name in self._parameters

    def parameter_type(self, function: str, parameter: str) -> str | None:
        """The JSON Schema `type` of a parameter (the first non-null one of a list), if known."""
        properties = self._parameters.get(function, {}).get("properties")
        if not isinstance(properties, Mapping):
            return None
        schema = properties.get(parameter)
        if not isinstance(schema, Mapping):
            return None
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        return kind if isinstance(kind, str) else None

    def typed_value(self, function: str, parameter: str, raw: str) -> Any:
        """A parameter's text as the value its schema asks for; the text itself where it does
        not parse as that type (or the schema says string)."""
        kind = self.parameter_type(function, parameter)
        if kind == "string":
            return raw
        text = raw.strip()
        if kind in ("integer", "number"):
            try:
                number = float(text)
            except ValueError:
                return raw
            if kind == "integer" and number.is_integer() and "." not in text and "e" not in text:
                return int(text)
            return number
        if kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return raw
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        try:  # objects, arrays, and parameters without a schema: JSON, else a Python literal
            return json.loads(text)
        except ValueError:
            pass
        if kind in ("object", "array"):
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return raw
            if isinstance(value, dict | list):
                return value
        return raw


def arguments_text(pairs: Sequence[tuple[str, Any]], *, closed: bool) -> str:
    """An arguments object written one parameter at a time: each text is a prefix of the next
    (`{"a": 1` then `{"a": 1, "b": 2` then, closed, `{"a": 1, "b": 2}`), so it can be streamed."""
    body = ", ".join(
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
        for k, v in pairs
    )
    return "{" + body + ("}" if closed else "")
