"""Each family's parser on what those models really write (fixture text in their formats, from
the models' chat templates and published outputs), whole and streamed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from trio_mlx.tools import FORMATS, ArgumentsAppended, CallStarted, Content, collect
from trio_mlx.tools.events import ParsedOutput

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array"},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]


@dataclass(frozen=True)
class Case:
    id: str
    format: str
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    reasoning: str = ""
    call_ids: list[str] | None = None


CASES = [
    # ---- Hermes / Qwen2.5 / Qwen3 -------------------------------------------------------------
    Case(
        "qwen2.5-one-call",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    Case(
        "qwen3-text-then-parallel-calls",
        "hermes",
        "I'll check both cities.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo \\"JP\\" {x}"}}\n'
        "</tool_call>",
        "I'll check both cities.",
        [
            ("get_weather", {"city": "Paris", "days": 2}),
            ("get_weather", {"city": 'Tokyo "JP" {x}'}),
        ],
    ),
    Case(
        "hermes-call-without-arguments-then-eos",
        "hermes",
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        "",
        [("get_time", {})],
    ),
    Case(
        "hermes-unterminated-at-eos",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    Case(
        "hermes-arguments-as-a-json-string",
        "hermes",
        '<tool_call>\n{"name": "get_weather", '
        '"arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>',
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    Case(
        "hermes-plain-answer-with-angle-brackets",
        "hermes",
        "Use a <tool> tag or x < y; no call <tool_cal here.",
        "Use a <tool> tag or x < y; no call <tool_cal here.",
    ),
    Case(
        "hermes-markup-that-is-not-a-call-stays-content",
        "hermes",
        "See <tool_call>not json</tool_call> done",
        "See<tool_call>not json</tool_call> done",
    ),
    # ---- Qwen3-Coder --------------------------------------------------------------------------
    Case(
        "qwen3-coder-typed-parameters",
        "qwen3_coder",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        "<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>",
        "Checking.",
        [("get_weather", {"city": "San Francisco", "days": 3, "metric": True, "hours": [9, 12]})],
    ),
    Case(
        "qwen3-coder-two-calls",
        "qwen3_coder",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>",
        "",
        [("get_time", {}), ("get_weather", {"city": "Lyon"})],
    ),
    # ---- Llama 3.1-3.3 ------------------------------------------------------------------------
    Case(
        "llama3.1-json",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}',
        "",
        [("get_weather", {"city": "Paris", "days": 1})],
    ),
    Case(
        "llama3.2-parallel-semicolon",
        "llama3_json",
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"type": "function", "name": "get_time", "parameters": {}}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    Case(
        "llama3-python-tag-json",
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice"}}',
        "",
        [("get_weather", {"city": "Nice"})],
    ),
    Case(
        "llama3-json-answer-is-not-a-call",
        "llama3_json",
        '{"name": "Ada", "age": 36}',
        '{"name": "Ada", "age": 36}',
    ),
    Case(
        "llama3-text-answer",
        "llama3_json",
        "The weather in Paris is sunny {mostly}.",
        "The weather in Paris is sunny {mostly}.",
    ),
    # ---- Mistral ------------------------------------------------------------------------------
    Case(
        "mistral-v3-json-list",
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    Case(
        "mistral-v11-parallel",
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    Case(
        "mistral-v11-call-id",
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Bern"}',
        "",
        [("get_weather", {"city": "Bern"})],
        call_ids=["a1b2c3d4e"],
    ),
    # ---- DeepSeek V3 / R1 / V3.1 --------------------------------------------------------------
    Case(
        "deepseek-v3",
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    Case(
        "deepseek-v3.1",
        "deepseek_v3",
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Kyiv", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Let me look.",
        [("get_weather", {"city": "Kyiv", "days": 2})],
    ),
    # ---- GLM-4.5 / 4.7 ------------------------------------------------------------------------
    Case(
        "glm-4.5",
        "glm45",
        "Let me search for that.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
        "</tool_call>\nThe weather will be...",
        "Let me search for that.\nThe weather will be...",
        [("get_weather", {"city": "Beijing", "days": 2})],
    ),
    Case(
        "glm-4.7-no-newlines",
        "glm45",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Xi'an</arg_value></tool_call>"
        "<tool_call>get_time</tool_call>",
        "",
        [("get_weather", {"city": "Xi'an"}), ("get_time", {})],
    ),
    # ---- Kimi K2 ------------------------------------------------------------------------------
    Case(
        "kimi-k2",
        "kimi_k2",
        "Let me help you with that.\n<|tool_calls_section_begin|>\n<|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Tokyo", "metric": true}'
        "<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
        "{}<|tool_call_end|>\n<|tool_calls_section_end|>",
        "Let me help you with that.",
        [("get_weather", {"city": "Tokyo", "metric": True}), ("get_time", {})],
        call_ids=["functions.get_weather:0", "functions.get_time:1"],
    ),
    # ---- gpt-oss (harmony) --------------------------------------------------------------------
    Case(
        "gpt-oss-call-after-analysis",
        "harmony",
        "<|channel|>analysis<|message|>User asks weather; call tool.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}'
        "<|call|>",
        "",
        [("get_weather", {"city": "Paris"})],
        reasoning="User asks weather; call tool.",
    ),
    Case(
        "gpt-oss-recipient-in-role-header",
        "harmony",
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
        "",
        [("get_time", {})],
    ),
    Case(
        "gpt-oss-final-answer",
        "harmony",
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is 4 o'clock.<|return|>",
        "It is 4 o'clock.",
        reasoning="Simple.",
    ),
    Case("gpt-oss-plain-text", "harmony", "No markup at all.", "No markup at all."),
    # ---- Gemma 3 ------------------------------------------------------------------------------
    Case(
        "gemma3-tool-code",
        "gemma3",
        'I will check.\n```tool_code\nget_weather(city="Paris", days=2)\n```',
        "I will check.",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    Case(
        "gemma3-tool-code-list",
        "gemma3",
        '```tool_code\n[get_weather(city="Rome"), get_time()]\n```',
        "",
        [("get_weather", {"city": "Rome"}), ("get_time", {})],
    ),
    Case(
        "gemma3-json",
        "gemma3",
        '```json\n{"name": "get_weather", "parameters": {"city": "Madrid"}}\n```',
        "",
        [("get_weather", {"city": "Madrid"})],
    ),
    Case(
        "gemma3-python-code-is-content",
        "gemma3",
        "```python\nprint(1)\n```",
        "```python\nprint(1)\n```",
    ),
]


def streamed(format_name: str, pieces: list[str]) -> tuple[ParsedOutput, list[Any]]:
    stream = FORMATS[format_name](TOOLS).stream()
    events = []
    for piece in pieces:
        events.extend(stream.feed(piece))
    events.extend(stream.finish())
    return collect(events), events


def summary(parsed: ParsedOutput) -> tuple[str, str, list[tuple[str, Any]]]:
    return (
        parsed.content,
        parsed.reasoning,
        [(c.name, json.loads(c.arguments)) for c in parsed.calls],
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_whole_output(case: Case) -> None:
    parsed = FORMATS[case.format](TOOLS).parse(case.text)
    assert summary(parsed) == (case.content, case.reasoning, case.calls)
    if case.call_ids is not None:
        assert [c.id for c in parsed.calls] == case.call_ids
    else:
        assert all(c.id.startswith("call_") for c in parsed.calls)
        assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_streamed_one_character_at_a_time_parses_the_same(case: Case) -> None:
    whole = FORMATS[case.format](TOOLS).parse(case.text)
    parsed, events = streamed(case.format, list(case.text))
    assert summary(parsed) == summary(whole)
    # No markup ever reaches the content, at any point of the stream.
    shown = "".join(e.text for e in events if isinstance(e, Content))
    assert shown == whole.content


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_split_in_two_at_every_boundary_parses_the_same(case: Case) -> None:
    whole = summary(FORMATS[case.format](TOOLS).parse(case.text))
    for cut in range(1, len(case.text)):
        parsed, _ = streamed(case.format, [case.text[:cut], case.text[cut:]])
        assert summary(parsed) == whole, f"split at {cut}: {case.text[:cut]!r}"


def test_a_call_is_announced_before_its_arguments_finish() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    stream = FORMATS["hermes"](TOOLS).stream()
    cut = text.index("Par")
    first = stream.feed(text[:cut])
    assert [type(e) for e in first] == [CallStarted, ArgumentsAppended]
    assert isinstance(first[0], CallStarted) and first[0].name == "get_weather"
    assert isinstance(first[1], ArgumentsAppended) and first[1].text == '{"city": "'
    rest = stream.feed(text[cut:]) + stream.finish()
    assert "".join(e.text for e in rest if isinstance(e, ArgumentsAppended)) == 'Paris"}'


def test_text_that_may_start_markup_is_held_until_it_cannot() -> None:
    stream = FORMATS["hermes"](TOOLS).stream()
    assert stream.feed("Hi <tool_") == [Content("Hi")]
    assert stream.feed("box> there") == [Content(" <tool_box> there")]
    assert stream.finish() == []


def test_streamed_arguments_of_a_long_value_grow_as_written() -> None:
    value = "x" * 200
    text = f'[TOOL_CALLS]get_weather[ARGS]{{"city": "{value}"}}'
    stream = FORMATS["mistral"](TOOLS).stream()
    pieces = [stream.feed(text[i : i + 7]) for i in range(0, len(text), 7)]
    growing = [p for p in pieces if any(isinstance(e, ArgumentsAppended) for e in p)]
    assert len(growing) > 20  # not one piece at the end
