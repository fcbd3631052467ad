"""Calls written as JSON objects (`{"name": ..., "arguments": {...}}`), read while they grow.

The arguments are reported as the model wrote them (the raw JSON text of the value), so that the
pieces streamed and the whole text agree; a value given as a JSON string holding JSON (some
models write `"arguments": "{\"a\": 1}"`) is reported once complete, as the string's text.
"""

from __future__ import annotations

import json
import re

from trio_mlx.tools.schemas import ToolSchemas
from trio_mlx.tools.sections import PartialCall

_WS = " \t\r\n"
_SCALAR_END = re.compile(r"[,}\]\s]")
ARGUMENT_KEYS = ("arguments", "parameters")


def string_end(text: str, start: int) -> int | None:
    """The index just past the JSON string that opens at `start`, None if it is not closed."""
    i = start + 1
    while True:
        quote = text.find('"', i)
        if quote < 0:
            return None
        backslashes = 0
        j = quote - 1
        while j > start and text[j] == "\\":
            backslashes += 1
            j -= 1
        if backslashes % 2 == 0:
            return quote + 1
        i = quote + 1


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that starts at `start`, None while it is incomplete."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return string_end(text, start)
    if first not in "{[":
        match = _SCALAR_END.search(text, start)
        return match.start() if match else None
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == '"':
            end = string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _skip(text: str, i: int, chars: str = _WS) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def object_fields(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level fields of the object opening at `start` as far as `text` goes: each key's
    value span (`end` None for a value still being written), and the index just past the
    object's closing brace (None while it is open). Stops at the first thing that is not JSON."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = _skip(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return fields, i + 1
        if text[i] != '"':
            return fields, None
        key_end = string_end(text, i)
        if key_end is None:
            return fields, None
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return fields, None
        i = _skip(text, key_end)
        if i >= len(text) or text[i] != ":":
            return fields, None
        i = _skip(text, i + 1)
        if i >= len(text):
            return fields, None
        end = value_end(text, i)
        fields[key] = (i, end)
        if end is None:
            return fields, None
        i = _skip(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
    return fields, None


def call_in_object(
    text: str, start: int, complete: bool, tools: ToolSchemas | None = None
) -> tuple[PartialCall | None, int | None]:
    """The call the object at `start` describes so far, and where the object ends."""
    fields, end = object_fields(text, start)
    closed = end is not None or complete
    name_span = fields.get("name")
    if name_span is None or name_span[1] is None:
        return None, end
    try:
        name = json.loads(text[name_span[0] : name_span[1]])
    except ValueError:
        return None, end
    if not isinstance(name, str) or not name or (tools is not None and not tools.accepts(name)):
        return None, end
    span = next((fields[k] for k in ARGUMENT_KEYS if k in fields), None)
    if span is None:
        return PartialCall(name, "{}" if end is not None else ""), end
    value_start, value_stop = span
    if text[value_start] == '"':  # JSON written inside a string: only once it is whole
        if value_stop is None:
            return PartialCall(name, ""), end
        try:
            inner = json.loads(text[value_start:value_stop])
        except ValueError:
            inner = ""
        return PartialCall(name, inner if isinstance(inner, str) else ""), end
    if value_stop is None:
        raw = text[value_start:]
        return PartialCall(name, raw.strip() if closed else raw.rstrip()), end
    return PartialCall(name, text[value_start:value_stop]), end


def calls_in_json(
    text: str,
    start: int,
    complete: bool,
    tools: ToolSchemas | None = None,
    separators: str = _WS + ",;[",
) -> tuple[list[PartialCall], int | None]:
    """The calls of consecutive JSON objects from `start` (separated by `separators`: a list,
    `;`-joined objects, or one object), and where the last complete one ends."""
    calls: list[PartialCall] = []
    last_end: int | None = None
    i = _skip(text, start, separators)
    while i < len(text) and text[i] == "{":
        call, end = call_in_object(text, i, complete, tools)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        last_end = end
        i = _skip(text, end, separators)
    return calls, last_end
