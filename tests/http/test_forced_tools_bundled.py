"""`tool_choice` "required" and named against `trio-mlx serve` on the real bundled SmolLM2 (its
chat template knows no tools), through the official openai client: the grammar makes even this
small model answer with calls whose arguments are valid against the tools' schemas."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from servers import serve_process
from trio_mlx.engine.default_model import default_gguf_path

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
TOOLS: Any = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check(calls: list[tuple[str, str]], allowed: set[str], parallel: bool) -> None:
    assert calls and (parallel or len(calls) == 1)
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.slow
def test_required_and_named_tool_choice_on_the_bundled_model() -> None:
    cases: list[tuple[Any, bool, set[str]]] = [
        ("required", True, {"get_weather", "get_time"}),
        ("required", False, {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, False, {"get_time"}),
    ]
    with serve_process(default_gguf_path()) as (_process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        for choice, parallel, allowed in cases:
            request: Any = {
                "model": model,
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": choice,
                "parallel_tool_calls": parallel,
                "temperature": 0,
                "max_tokens": 200,
            }
            reply = client.chat.completions.create(**request)
            choice_out = reply.choices[0]
            assert choice_out.finish_reason == "tool_calls", choice_out.message
            assert choice_out.message.content is None and choice_out.message.tool_calls
            made = [(c.function.name, c.function.arguments) for c in choice_out.message.tool_calls]
            check(made, allowed, parallel)

            names: dict[int, str] = {}
            arguments: dict[int, str] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **request):
                delta = chunk.choices[0].delta
                assert not delta.content
                for call in delta.tool_calls or ():
                    assert call.function is not None
                    if call.index not in names:
                        assert call.id and call.function.name
                        names[call.index] = call.function.name
                    arguments[call.index] = arguments.get(call.index, "") + (
                        call.function.arguments or ""
                    )
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls"
            assert [(names[i], arguments[i]) for i in sorted(names)] == made

        response = client.responses.create(
            model=model,
            input="What is the weather like in Paris today?",
            tools=[{"type": "function", **t["function"]} for t in TOOLS],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=200,
        )
        assert response.status == "completed"
        items = [(o.name, o.arguments) for o in response.output if o.type == "function_call"]
        assert len(items) == len(response.output)
        check(items, {"get_weather"}, True)
