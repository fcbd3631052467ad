"""Reading the JSON the forced tool-call grammar makes the model write (`ForcedCallStream`,
`ForcedCallReader`), and the plan that asks for it: streamed in any pieces it gives the same
calls as read whole; a call cut short is never reported as made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from trio_mlx.http.tooling import CallReader, ForcedCallReader, plan_tools
from trio_mlx.structured import OutputFormat, forced_tool_calls_format, parse_forced_tool_calls
from trio_mlx.tools import ArgumentsAppended, CallStarted, ToolEvent, collect

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
ONE = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}, [x]"}}'
MANY = (
    '[{"name": "get_weather", "arguments": {"city": "Paris", "near": {"a": [1, {"b": 2}]}}}, '
    '{"name": "get_time", "arguments": {}}]'
)


def events_in_pieces(reader: CallReader, text: str, sizes: list[int]) -> list[ToolEvent]:
    events: list[ToolEvent] = []
    at = 0
    for size in sizes:
        events += reader.feed(text[at : at + size])
        at += size
    return events + reader.feed(text[at:]) + reader.finish()


@pytest.mark.parametrize("text", [ONE, MANY])
def test_split_at_every_character_the_calls_are_the_whole_texts(text: str) -> None:
    expected = [(c.name, c.arguments) for c in parse_forced_tool_calls(text)]
    whole = ForcedCallReader(parallel=True).parse(text)
    assert whole.content == "" and [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        (name, json.loads(arguments)) for name, arguments in expected
    ]
    for cut in range(len(text) + 1):
        reader = ForcedCallReader(parallel=True)
        events = events_in_pieces(reader, text, [cut])
        parsed = collect(events)
        assert [(c.name, c.arguments) for c in parsed.calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
        assert parsed.content == ""
        assert reader.calls == len(whole.calls)
    char_by_char = ForcedCallReader(parallel=True)
    events = events_in_pieces(char_by_char, text, [1] * len(text))
    starts = [e for e in events if isinstance(e, CallStarted)]
    assert [s.name for s in starts] == [c.name for c in whole.calls]
    # The name comes first, then the arguments in many pieces.
    first = events.index(starts[0])
    assert all(not isinstance(e, ArgumentsAppended) for e in events[:first])
    assert sum(isinstance(e, ArgumentsAppended) and e.index == 0 for e in events) > 5


def test_a_cut_call_is_not_made_whole_or_streamed() -> None:
    cut = MANY[: MANY.index('"get_time"') + 20]  # inside the second call's arguments
    reader = ForcedCallReader(parallel=True)
    parsed = reader.parse(cut)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert reader.calls == 1
    streamed = ForcedCallReader(parallel=True)
    events = events_in_pieces(streamed, cut, [3] * (len(cut) // 3))
    assert [e.name for e in events if isinstance(e, CallStarted)] == ["get_weather", "get_time"]
    assert streamed.calls == 1  # the second one was started, never completed
    inside_first = ForcedCallReader(parallel=False)
    assert inside_first.parse(ONE[:-3]).calls == [] and inside_first.calls == 0


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    reader = ForcedCallReader(parallel=False)
    parsed = reader.parse(MANY)
    assert [c.name for c in parsed.calls] == ["get_weather"] and reader.calls == 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [("required", None), ({"type": "function", "function": {"name": "get_time"}}, False)],
)
def test_a_forced_plan_carries_the_grammar_and_a_forced_reader(
    tokenizer: Any, choice: Any, parallel: bool | None
) -> None:
    messages = [{"role": "user", "content": "Weather?"}]
    plan = plan_tools(messages, TOOLS, choice, parallel, tokenizer=tokenizer, parser="auto")
    name = "required" if choice == "required" else "get_time"
    expected = forced_tool_calls_format(TOOLS, name, parallel is not False)
    grammar = plan.options["output_format"]
    assert isinstance(grammar, OutputFormat) and grammar == expected
    assert grammar.param == "tool_choice"
    assert isinstance(plan.reader(), ForcedCallReader)
    auto = plan_tools(messages, TOOLS, "auto", parallel, tokenizer=tokenizer, parser="auto")
    assert auto.options == {}
    reader = auto.reader()
    assert reader is not None and not isinstance(reader, ForcedCallReader)
