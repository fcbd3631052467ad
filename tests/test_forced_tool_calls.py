"""Forcing a tool call (`tool_choice` "required" or a named function) on the real bundled
SmolLM2, whose chat template knows no tools: under the grammar of `forced_tool_calls_format`
it still writes a call whose arguments are valid against the chosen tool's parameters."""

from __future__ import annotations

import pytest

import trio_mlx
from tool_fixtures import BUNDLED_ASK, BUNDLED_TOOLS, check_calls, parameters_by_name
from trio_mlx.structured import forced_tool_calls_format, parse_forced_tool_calls

PARAMETERS = parameters_by_name(BUNDLED_TOOLS)


@pytest.mark.slow
async def test_required_and_named_tool_choice_give_schema_valid_calls() -> None:
    cases: list[tuple[str, bool, set[str]]] = [
        ("required", False, {"get_weather", "get_time"}),
        ("get_time", False, {"get_time"}),
        ("required", True, {"get_weather", "get_time"}),
    ]
    async with trio_mlx.open_engine() as engine:
        for choice, parallel, allowed in cases:
            fmt = forced_tool_calls_format(BUNDLED_TOOLS, choice, parallel, max_calls=2)
            out = await engine.chat(
                BUNDLED_ASK, tools=BUNDLED_TOOLS, max_tokens=120, temperature=0, output_format=fmt
            )
            assert out.finish_reason == "stop", out.text
            calls = parse_forced_tool_calls(out.text)
            made = [(call.name, call.arguments) for call in calls]
            check_calls(made, allowed, parallel, PARAMETERS)
