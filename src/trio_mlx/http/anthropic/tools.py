"""Anthropic's `tools` and `tool_choice` on the OpenAI routes' tool machinery (`http/tooling.py`).

- A tool `{name, description, input_schema}` is the function `{name, description, parameters}`;
  names are unique and `input_schema` is an object schema (`type: "object"`), else a 400 naming
  the field. A tool of another `type` than `custom` (Anthropic's server tools, `web_search_...`,
  and its own client tools, `bash_...`, `text_editor_...`, whose schema only Claude knows) is a
  400 naming its `type`.
- `tool_choice`: `auto` (or absent) is "auto"; `any` is "required"; `{"type": "tool", "name"}` is
  the named function (a name that is not among the tools: 400 on `tool_choice.name`); `none`
  offers nothing and reads nothing. `any` and `tool` without tools are a 400 on
  `tool_choice.type`. `disable_parallel_tool_use: true` is `parallel_tool_calls: false` (one
  call at most; with `any` or `tool`, exactly one is asked for).
- Forcing (`any`, `tool`) goes where the OpenAI routes' does: the instruction in the prompt and
  `forced_tool_calls_format`'s generation options (constrained decoding, where it is wired).
"""

from __future__ import annotations

import re
from typing import Any

from trio_mlx.http.anthropic.requests import CountTokensRequest
from trio_mlx.http.errors import APIError
from trio_mlx.http.tooling import ToolPlan, plan_tools

_FUNCTION_PARAMETERS = re.compile(r"^tools\[(\d+)\]\.function\.parameters")


def chat_tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The request's tools in the chat shape (`{"type": "function", "function": {...}}`)."""
    if not body.tools:
        return None
    out = []
    seen: set[str] = set()
    for i, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise APIError(
                400,
                f"tools of type {tool.type!r} (Anthropic's server tools and Anthropic-defined "
                "tools) are not served by this server: give a client tool, with `name`, "
                "`description` and `input_schema`",
                param=f"tools[{i}].type",
                code="unsupported_value",
            )
        if tool.input_schema is None:
            raise APIError(
                400,
                "a client tool needs `input_schema` (the JSON Schema of its input)",
                param=f"tools[{i}].input_schema",
                code="missing_required_parameter",
            )
        if tool.input_schema.get("type") != "object":
            raise APIError(
                400,
                'input_schema must be a JSON Schema of an object (`"type": "object"`)',
                param=f"tools[{i}].input_schema.type",
                code="invalid_value",
            )
        if tool.name in seen:
            raise APIError(
                400,
                f"tool names must be unique: {tool.name!r} is given twice",
                param=f"tools[{i}].name",
                code="invalid_value",
            )
        seen.add(tool.name)
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(body: CountTokensRequest) -> tuple[Any, bool | None]:
    """`tool_choice` as the chat route's (`"auto"`, `"required"`, `"none"` or a named function)
    and its `parallel_tool_calls`; raises `APIError` for a choice the tools cannot meet."""
    choice = body.tool_choice
    if choice is None:
        return "auto", None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type in ("auto", "none"):
        return choice.type, parallel
    if not body.tools:
        raise APIError(
            400,
            f"tool_choice {choice.type!r} needs tools",
            param="tool_choice.type",
            code="invalid_value",
        )
    if choice.type == "any":
        return "required", parallel
    if choice.name is None:
        raise APIError(
            400,
            "tool_choice of type 'tool' needs the tool's name",
            param="tool_choice.name",
            code="missing_required_parameter",
        )
    if choice.name not in {tool.name for tool in body.tools}:
        raise APIError(
            400,
            f"tool_choice names the tool {choice.name!r}, which is not among the tools",
            param="tool_choice.name",
            code="invalid_value",
        )
    return {"type": "function", "function": {"name": choice.name}}, parallel


def plan(
    body: CountTokensRequest, messages: list[dict[str, Any]], *, tokenizer: Any, parser: str
) -> ToolPlan:
    """The `ToolPlan` of a Messages request whose template messages are `messages`."""
    tools = chat_tools(body)
    choice, parallel = chat_tool_choice(body)
    try:
        return plan_tools(messages, tools, choice, parallel, tokenizer=tokenizer, parser=parser)
    except APIError as exc:  # about a tool's schema, in the chat shape: the request's field
        exc.param = _FUNCTION_PARAMETERS.sub(r"tools[\1].input_schema", exc.param or "") or None
        raise
