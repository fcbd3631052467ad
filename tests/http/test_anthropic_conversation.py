"""An Anthropic conversation as the chat template takes it: tool_use blocks as an assistant
turn's calls, tool_result blocks as tool messages, image blocks as media parts, and the engine's
field names turned back into the request's; through a template that renders tools itself."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from trio_mlx.http.anthropic import tools
from trio_mlx.http.anthropic.conversation import conversation
from trio_mlx.http.anthropic.requests import CountTokensRequest
from trio_mlx.http.errors import APIError
from trio_mlx.tools.hermes import HermesFormat

WEATHER = {
    "name": "get_weather",
    "description": "The weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
# In the shape of Qwen2.5's template: tools in a system turn, calls with `arguments | tojson`.
QWEN_LIKE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
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
LOOP: Any = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "two cities", "signature": ""},
            {"type": "text", "text": "Checking."},
            {
                "type": "tool_use",
                "id": "toolu_a",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
            {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Rome"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "sunny"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_b",
                "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "cold"}],
                "is_error": False,
            },
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]


def request(messages: Any, **fields: Any) -> CountTokensRequest:
    return CountTokensRequest.model_validate({"messages": messages, **fields}, strict=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    loaded.chat_template = QWEN_LIKE
    return loaded


def test_calls_and_results_become_the_template_s_calls_and_tool_messages() -> None:
    chat = conversation(request(LOOP))
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "tool", "tool", "user"]
    assistant = chat.messages[1]
    assert assistant["content"] == "Checking."  # the thinking block dropped
    assert [(c["id"], c["function"]["name"]) for c in assistant["tool_calls"]] == [
        ("toolu_a", "get_weather"),
        ("toolu_b", "get_weather"),
    ]
    assert assistant["tool_calls"][1]["function"]["arguments"] == '{"city": "Rome"}'
    assert chat.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_a"}
    assert chat.messages[3]["content"] == "rain\ncold"
    assert chat.messages[4] == {"role": "user", "content": "And tomorrow?"}
    assert not chat.prefill and chat.origins == [f"messages[{i}]" for i in (0, 1, 2, 2, 2)]


def test_a_template_that_knows_tools_renders_them_and_the_history(tokenizer: Any) -> None:
    body = request(LOOP, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    chat = conversation(body)
    plan = tools.plan(body, chat.messages, tokenizer=tokenizer, parser="auto")
    assert isinstance(plan.call_format, HermesFormat) and plan.forced == "get_weather"
    assert plan.template_tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather",
            },
        }
    ]
    text = tokenizer.apply_chat_template(
        plan.messages, tools=plan.template_tools, tokenize=False, add_generation_prompt=True
    )
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text  # an object
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert "You must answer with a call of the function get_weather." in text


def test_an_error_result_is_marked_and_a_prefill_with_calls_is_closed() -> None:
    messages: Any = [
        *LOOP[:2],
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "is_error": True}],
        },
    ]
    chat = conversation(request(messages))
    assert chat.messages[-1] == {"role": "tool", "content": "Error", "tool_call_id": "toolu_a"}
    closed = conversation(request(LOOP[:2]))
    assert not closed.prefill and closed.template_kwargs is None
    open_turn = conversation(request([LOOP[0], {"role": "assistant", "content": "It is"}]))
    assert open_turn.prefill and open_turn.template_kwargs == {"continue_final_message": True}


def test_image_blocks_are_media_parts_and_errors_name_the_request_s_block() -> None:
    data = base64.b64encode(b"png bytes").decode()
    source = {"type": "base64", "media_type": "image/png", "data": data}
    messages: Any = [
        {"role": "user", "content": "first"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                {"type": "image", "source": source},
            ],
        },
    ]
    chat = conversation(request(messages, system="Be brief."))
    user = chat.messages[1]  # the two user turns merged, after the system message
    assert user["content"] == [
        {"type": "text", "text": "first"},
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
    ]
    for engine_param, added, expected in [
        ("messages[1].content[3].image_url", 0, "messages[1].content[2].source"),
        ("messages[2].content[2].image_url", 1, "messages[1].content[1].source"),
        ("messages[1].content[0]", 0, "messages[0].content[0]"),
        ("messages[0]", 0, "system"),
        ("messages", 0, "messages"),
    ]:
        error = APIError(400, "bad", param=engine_param)
        chat.name_field(error, added=added)
        assert error.param == expected, engine_param


@pytest.mark.parametrize(
    ("block", "param"),
    [
        ({"type": "tool_use", "id": "t", "name": "f"}, "messages[1].content[0].input"),
        ({"type": "tool_use", "input": {}, "name": "f"}, "messages[1].content[0].id"),
        ({"type": "image", "source": {"type": "url", "url": "x"}}, "messages[1].content[0].type"),
    ],
)
def test_blocks_out_of_place_or_incomplete_are_400s(block: Any, param: str) -> None:
    messages: Any = [LOOP[0], {"role": "assistant", "content": [block]}]
    with pytest.raises(APIError) as refused:
        conversation(request(messages))
    assert refused.value.status == 400 and refused.value.param == param


def test_a_tool_result_holds_text_and_image_blocks_only() -> None:
    def refusal(*items: Any) -> str | None:
        result = {"type": "tool_result", "tool_use_id": "t", "content": list(items)}
        with pytest.raises(APIError) as refused:
            conversation(request([{"role": "user", "content": [result]}]))
        return refused.value.param

    text = {"type": "text", "text": "x"}
    document = {"type": "document", "source": {"type": "text", "data": "x"}}
    assert refusal(text, document) == "messages[0].content[0].content[1].type"
    image = {"type": "image", "source": {}}
    assert refusal(text, image) == "messages[0].content[0].content[1].source.type"


def test_a_tool_result_s_images_are_media_parts_of_its_tool_message() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image], "is_error": True}
    chat = conversation(request([*LOOP[:2], {"role": "user", "content": [result]}]))
    assert chat.messages[-1] == {
        "role": "tool",
        "tool_call_id": "t",
        "content": [
            {"type": "text", "text": "Error"},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        ],
    }
    exc = APIError(400, "bad", param=f"messages[{len(chat.messages) - 1}].content[1].image_url")
    chat.name_field(exc)
    assert exc.param == "messages[2].content[0].content[0].source"


def test_thinking_handed_back_is_the_turn_s_reasoning_only_where_the_template_renders_it() -> None:
    kept = conversation(request(LOOP), keep_reasoning=True).messages[1]
    assert kept["reasoning_content"] == "two cities" and kept["content"] == "Checking."
    assert "reasoning_content" not in conversation(request(LOOP)).messages[1]
