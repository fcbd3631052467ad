"""Forcing a tool call: the grammar for `tool_choice: "required"` or a named function, and
reading the calls back out of the generated text.

Under the grammar the model writes the call as JSON, whatever its chat template's own tool
markup: `{"name": "get_weather", "arguments": {"city": "Paris"}}`, or with parallel calls a
non-empty array of such objects. Each alternative pairs one tool's name (a `const`) with that
tool's own `parameters` schema, so that arguments always match the tool that is named. The
caller (the chat or Responses route) turns the text back into `ToolCall`s with
`parse_forced_tool_calls`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from trio_mlx.errors import InvalidRequest
from trio_mlx.structured.formats import OutputFormat
from trio_mlx.tools.calls import ToolCall

#: The arguments of a tool that declares no parameters: an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def forced_tool_calls_format(
    tools: Sequence[Mapping[str, Any]],
    choice: str,
    parallel: bool,
    *,
    max_calls: int | None = None,
    param: str = "tool_choice",
) -> OutputFormat:
    """The output format that makes the model call a tool.

    `tools`: OpenAI function tools, as chat completions sends them
    (`{"type": "function", "function": {"name", "parameters", ...}}`) or as the Responses API
    does (`{"type": "function", "name", "parameters", ...}`); other tool types are skipped.
    `choice`: `"required"` (any of the tools) or the name of one. `parallel`: an array of one
    or more calls (at most `max_calls`) instead of exactly one call.

    `InvalidRequest` naming `param` when there is no function tool to call, or `choice` names
    none of them; one naming `tools[i].function.parameters` for a parameters schema that is
    not an object (`...parameters.type` for a schema of another type; a schema that names no
    type is held to an object, as arguments always are).
    """
    functions = _function_tools(tools)
    if choice == "required":
        chosen = functions
        if not chosen:
            raise InvalidRequest(
                'tool_choice "required" needs at least one function tool', param=param
            )
    else:
        chosen = [f for f in functions if f[1] == choice]
        if not chosen:
            names = ", ".join(repr(f[1]) for f in functions) or "none"
            raise InvalidRequest(
                f"tool_choice names the function {choice!r}, which is not among the tools "
                f"(functions: {names})",
                param=param,
            )
    defs: dict[str, Any] = {}
    alternatives = []
    for index, name, parameters in chosen:
        arguments = _arguments_schema(index, parameters, defs)
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call: dict[str, Any] = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    schema: dict[str, Any] = call
    if parallel:
        schema = {"type": "array", "items": call, "minItems": 1}
        if max_calls is not None:
            schema["maxItems"] = max_calls
    if defs:
        schema = {**schema, "$defs": defs}
    return OutputFormat.json_schema(schema, strict=False, param=param)


def parse_forced_tool_calls(text: str) -> list[ToolCall]:
    """The calls in `text` generated under `forced_tool_calls_format` (one call object, or an
    array of them). `arguments` is the JSON text of the arguments object. `ValueError` for text
    that is not such JSON (a generation cut short by `max_tokens`, say)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the forced tool call is not complete JSON: {exc}") from exc
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("name"), str)
            or not isinstance(item.get("arguments", {}), dict)
        ):
            raise ValueError(f"not a tool call: {json.dumps(item)[:200]}")
        arguments = json.dumps(item.get("arguments", {}), ensure_ascii=False)
        calls.append(ToolCall(name=item["name"], arguments=arguments))
    return calls


def _function_tools(tools: Sequence[Mapping[str, Any]]) -> list[tuple[int, str, Any]]:
    """(index in `tools`, name, parameters) of every function tool."""
    found = []
    for index, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            continue
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        found.append((index, function["name"], function.get("parameters")))
    return found


def _arguments_schema(index: int, parameters: Any, defs: dict[str, Any]) -> Any:
    """The schema of one tool's arguments, placed so that its own `$ref`s still resolve: a
    schema with references moves into the root's `$defs` (as `tool<index>`) and its `#/...`
    pointers are rewritten to point there."""
    where = f"tools[{index}].function.parameters"
    if parameters is None:
        return NO_PARAMETERS
    if parameters is True:
        return {"type": "object"}
    if not isinstance(parameters, Mapping):
        raise InvalidRequest("a tool's parameters must be a JSON Schema object", param=where)
    parameters = _object_schema(parameters, where)
    if not _has_ref(parameters):
        return copy.deepcopy(parameters)
    key = f"tool{index}"
    defs[key] = _rebase_refs(parameters, f"#/$defs/{key}/")
    return {"$ref": f"#/$defs/{key}"}


def _object_schema(parameters: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`parameters` held to an object: arguments are a JSON object whatever the schema leaves
    open (`{}`, a schema without `type`, `["object", "null"]`); a schema of another type is an
    `InvalidRequest` naming its `type` (as OpenAI refuses it)."""
    kind = parameters.get("type")
    if kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind):
        return {**parameters, "type": "object"}
    raise InvalidRequest(
        f'a tool\'s parameters must be a JSON Schema of an object (`"type": "object"`), '
        f"not of type {json.dumps(kind)}",
        param=f"{where}.type",
    )


def _has_ref(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "$ref" in value or any(_has_ref(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_ref(v) for v in value)
    return False


def _rebase_refs(value: Any, base: str) -> Any:
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = base + v[1:].lstrip("/") if v not in ("#", "#/") else base.rstrip("/")
            else:
                out[k] = _rebase_refs(v, base)
        return out
    if isinstance(value, list):
        return [_rebase_refs(v, base) for v in value]
    return value
