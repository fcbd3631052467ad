"""Forcing a tool call (`tool_choice` "required" or a named function) on the real bundled
SmolLM2, whose chat template knows no tools: under the grammar of `forced_tool_calls_format`
it still writes a call whose arguments are valid against the chosen tool's parameters."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

import trio_mlx
from trio_mlx.structured import forced_tool_calls_format, parse_forced_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]


@pytest.mark.slow
async def test_required_and_named_tool_choice_give_schema_valid_calls() -> None:
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    cases: list[tuple[str, bool, set[str]]] = [
        ("required", False, {"get_weather", "get_time"}),
        ("get_time", False, {"get_time"}),
        ("required", True, {"get_weather", "get_time"}),
    ]
    async with trio_mlx.open_engine() as engine:
        for choice, parallel, allowed in cases:
            fmt = forced_tool_calls_format(TOOLS, choice, parallel, max_calls=2)
            out = await engine.chat(
                messages, tools=TOOLS, max_tokens=120, temperature=0, output_format=fmt
            )
            assert out.finish_reason == "stop", out.text
            calls = parse_forced_tool_calls(out.text)
            assert calls and (parallel or len(calls) == 1)
            for call in calls:
                assert call.name in allowed
                arguments: Any = json.loads(call.arguments)
                jsonschema.validate(arguments, PARAMETERS[call.name])
