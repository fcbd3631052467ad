"""`tool_choice` "required" and named against `trio-mlx serve` on the real bundled SmolLM2 (its
chat template knows no tools), through the official openai client: the grammar makes even this
small model answer with calls whose arguments are valid against the tools' schemas."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from servers import serve_process
from tool_fixtures import (
    BUNDLED_ASK,
    BUNDLED_TOOLS,
    check_calls,
    parameters_by_name,
    responses_tool,
)
from trio_mlx.engine.default_model import default_gguf_path

PARAMETERS = parameters_by_name(BUNDLED_TOOLS)


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
                "messages": BUNDLED_ASK,
                "tools": BUNDLED_TOOLS,
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
            check_calls(made, allowed, parallel, PARAMETERS)

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
            tools=[responses_tool(t) for t in BUNDLED_TOOLS],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=200,
        )
        assert response.status == "completed"
        items = [(o.name, o.arguments) for o in response.output if o.type == "function_call"]
        assert len(items) == len(response.output)
        check_calls(items, {"get_weather"}, True, PARAMETERS)
