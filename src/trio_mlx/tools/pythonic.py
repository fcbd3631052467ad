"""Calls written as Python function calls (`get_weather(city="Paris")`, or a list of them), as
Gemma 3's `tool_code` blocks and Llama's built-in tools (`brave_search.call(query="x")`) write
them. Keyword arguments with literal values only; anything else is not a call."""

from __future__ import annotations

import ast
import json

from trio_mlx.tools.sections import PartialCall


def pythonic_calls(text: str, *, strip_call_suffix: bool = False) -> list[PartialCall]:
    """The calls `text` holds, all or nothing. `strip_call_suffix`: `tool.call(...)` names
    `tool` (Llama's built-in tool syntax)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    nodes = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return []
        name = _dotted(node.func)
        if name is None:
            return []
        if strip_call_suffix and name.endswith(".call"):
            name = name[: -len(".call")]
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return []
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return []
        try:
            text_arguments = json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError):  # sets, bytes, complex: not JSON
            return []
        calls.append(PartialCall(name, text_arguments))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
