"""How a request's tools reach the chat template, and which parser reads the reply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from trio_mlx.http.errors import APIError
from trio_mlx.http.tooling import forced_function, plan_tools
from trio_mlx.tools import detect_format
from trio_mlx.tools.hermes import HermesFormat

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# A template in the shape of Qwen2.5's: tools in the system turn, earlier calls rendered with
# `tool_call.arguments | tojson` (so arguments must be an object, not JSON text).
QWEN_LIKE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CONVERSATION: Any = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_template_that_knows_tools_gets_them_and_arguments_as_objects(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_LIKE
    plan = plan_tools(CONVERSATION, TOOLS, "auto", None, tokenizer=tokenizer, parser="auto")
    assert plan.template_tools == TOOLS
    assert isinstance(plan.call_format, HermesFormat)
    text = tokenizer.apply_chat_template(
        plan.messages, tools=plan.template_tools, tokenize=False, add_generation_prompt=True
    )
    assert '"arguments": {"city": "Paris"}' in text  # an object, not JSON text in a string
    assert "<tools>" in text and "<tool_response>\nsunny\n</tool_response>" in text


def test_a_template_without_tools_gets_the_fallback_prompt_and_history(tokenizer: Any) -> None:
    tokenizer.chat_template = AutoTokenizer.from_pretrained(
        tokenizer.name_or_path
    ).chat_template  # SmolLM2's, which ignores `tools`
    plan = plan_tools(CONVERSATION, TOOLS, "auto", None, tokenizer=tokenizer, parser="auto")
    assert plan.template_tools is None
    assert isinstance(plan.call_format, HermesFormat)
    system = plan.messages[0]
    assert system["role"] == "system" and "<tools>" in system["content"]
    assert json.dumps(TOOLS[0]) in system["content"]
    assert plan.messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
    }
    assert plan.messages[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>",
    }


def test_tool_choice_none_still_renders_the_history_but_offers_nothing(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_LIKE
    plan = plan_tools(CONVERSATION, TOOLS, "none", None, tokenizer=tokenizer, parser="auto")
    assert plan.template_tools is None and plan.call_format is None and plan.reader() is None
    assert plan.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_a_named_parser_overrides_the_template(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_LIKE
    plan = plan_tools(CONVERSATION, TOOLS, "auto", None, tokenizer=tokenizer, parser="mistral")
    assert plan.call_format is not None and plan.call_format.name == "mistral"


@pytest.mark.parametrize(
    ("choice", "forced"),
    [
        (None, None),
        ("auto", None),
        ("none", None),
        ("required", "required"),
        ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ],
)
def test_tool_choice_values(choice: Any, forced: str | None) -> None:
    assert forced_function(TOOLS, choice) == forced


def test_the_responses_api_names_the_function_at_the_top() -> None:
    choice = {"type": "function", "name": "get_weather"}
    assert forced_function(TOOLS, choice, nested=False) == "get_weather"
    with pytest.raises(APIError):
        forced_function(TOOLS, choice)  # not chat's shape


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "function": {"name": "other"}},
        {"type": "code", "function": {"name": "get_weather"}},
        {"type": "function"},
        "sometimes",
    ],
)
def test_bad_tool_choice_is_a_400_on_tool_choice(choice: Any) -> None:
    with pytest.raises(APIError) as refused:
        forced_function(TOOLS, choice)
    assert refused.value.status == 400 and refused.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ({"id": "x"}, "messages[1].tool_calls[0].function"),
        ({"function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
        (
            {"function": {"name": "f", "arguments": {}}},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"id": 3, "function": {"name": "f"}}, "messages[1].tool_calls[0].id"),
        ({"type": "code", "function": {"name": "f"}}, "messages[1].tool_calls[0].type"),
    ],
)
def test_a_bad_call_in_the_history_is_refused(tokenizer: Any, call: Any, param: str) -> None:
    bad = [CONVERSATION[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(APIError) as refused:
        plan_tools(bad, TOOLS, "auto", None, tokenizer=tokenizer, parser="auto")
    assert refused.value.param == param


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN_LIKE, "hermes"),
        ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}<parameter=", "qwen3_coder"),
        ("{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}", "llama3_json"),
        ("{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3_json"),
        ('{{- "[TOOL_CALLS][" }}{%- for tool in message.tool_calls %}', "mistral"),
        (
            "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}",
            "deepseek_v3",
        ),
        ("{{ '<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key><arg_value>", "glm45"),
        ("<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}", "kimi_k2"),
        ("{{- '<|channel|>commentary to=functions.' + tool_call.name }}", "harmony"),
        ("{{ '<start_of_turn>' + role + '\\n' }}", None),
    ],
)
def test_the_format_is_detected_from_the_chat_template(template: str, expected: str | None) -> None:
    assert detect_format(template) == expected


def test_gpt_oss_replies_are_read_by_channel_even_without_tools(tokenizer: Any) -> None:
    tokenizer.chat_template = "{{- '<|start|>assistant<|channel|>final<|message|>' }} to=functions."
    plan = plan_tools(CONVERSATION[:1], None, None, None, tokenizer=tokenizer, parser="auto")
    reader = plan.reader()
    assert reader is not None
    parsed = reader.parse(
        "<|channel|>analysis<|message|>hm<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello.<|return|>"
    )
    assert (parsed.reasoning, parsed.content, parsed.calls) == ("hm", "Hello.", [])


def test_a_named_format_with_its_own_fallback_syntax_is_asked_for(tokenizer: Any) -> None:
    tokenizer.chat_template = "{{ '<start_of_turn>' }}{{ messages[0]['content'] }}"
    plan = plan_tools(CONVERSATION[:1], TOOLS, "auto", None, tokenizer=tokenizer, parser="gemma3")
    assert plan.call_format is not None and plan.call_format.name == "gemma3"
    assert "```tool_code" in plan.messages[0]["content"]
    assert "<tool_call>" not in plan.messages[0]["content"]
