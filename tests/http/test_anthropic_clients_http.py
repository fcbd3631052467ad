"""What the official `anthropic` client and what is built on it read beyond a message, against
the real server on the tiny random model: the `request-id` every answer carries, the model list
in Anthropic's shape, the SDK's tool runner (which asks for server-held message threads first),
documents of text, thinking blocks handed back, and the tools and MCP servers this server does not
serve."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
from anthropic import beta_async_tool

from servers import running_server
from tool_fixtures import ASK, CALL, scripted_server
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.http.server import RunningServer

USER: Any = [{"role": "user", "content": "Name a colour."}]


def claude_for(server: RunningServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=30
    )


@pytest.fixture
async def aliased(tiny_model_dir: Path) -> AsyncIterator[RunningServer]:
    """The tiny model served under three names, the first the canonical one."""
    names = ("tiny", "claude-alias", "third")
    async with running_server(tiny_model_dir, served_model_names=names) as server:
        yield server


async def test_every_answer_carries_a_request_id_the_client_reads(server: RunningServer) -> None:
    async with claude_for(server) as claude:
        raw = await claude.messages.with_raw_response.create(
            model="tiny", max_tokens=2, messages=USER
        )
        message = await raw.parse()
        assert raw.headers["request-id"].startswith("req_")
        assert message._request_id == raw.headers["request-id"]
        async with claude.messages.stream(model="tiny", max_tokens=2, messages=USER) as stream:
            assert stream.response.headers["request-id"].startswith("req_")
            await stream.get_final_message()
        counted = await claude.messages.count_tokens(model="tiny", messages=USER)
        assert counted._request_id is not None and counted._request_id.startswith("req_")
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(model="tiny", max_tokens=0, messages=USER)
    # An error names its request in the header, the body and the client's exception text.
    error = refused.value
    request_id = error.response.headers["request-id"]
    assert request_id.startswith("req_") and request_id != message._request_id
    body: Any = error.body
    assert body["request_id"] == request_id and request_id in str(error)
    # Each request has its own id; the OpenAI routes' answers have none.
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        ids = {
            (await http.post("/v1/messages/count_tokens", json={"messages": USER})).headers[
                "request-id"
            ]
            for _ in range(3)
        }
        assert len(ids) == 3
        chat = await http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
        assert chat.status_code == 200 and "request-id" not in chat.headers


async def test_the_model_list_is_anthropic_s_for_an_anthropic_client(
    aliased: RunningServer,
) -> None:
    async with claude_for(aliased) as claude:
        listed = [model async for model in claude.models.list()]
        assert [model.id for model in listed] == ["tiny", "claude-alias", "third"]
        for model in listed:
            assert model.type == "model" and model.display_name == model.id
            assert isinstance(model.created_at, datetime.datetime)
            assert model.created_at.timestamp() == aliased.state.created
            assert model.max_input_tokens == aliased.state.engine.context_length  # type: ignore[union-attr]
        # Paged as Anthropic pages: the client follows `has_more` and `last_id`.
        assert [model.id async for model in claude.models.list(limit=1)] == [
            "tiny",
            "claude-alias",
            "third",
        ]
        page = await claude.models.list(limit=2)
        assert [m.id for m in page.data] == ["tiny", "claude-alias"] and page.has_more
        assert (page.first_id, page.last_id) == ("tiny", "claude-alias")
        after = await claude.models.list(after_id="tiny")
        assert [m.id for m in after.data] == ["claude-alias", "third"] and not after.has_more
        before = await claude.models.list(before_id="third", limit=1)
        assert [m.id for m in before.data] == ["claude-alias"] and before.has_more
        one = await claude.models.retrieve("claude-alias")
        assert one.id == "claude-alias" and one.type == "model"
        with pytest.raises(anthropic.NotFoundError) as missing:
            await claude.models.retrieve("claude-opus")
        body: Any = missing.value.body
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.models.list(after_id="nope")
        assert str(bad.value.body["error"]["message"]).startswith("after_id: ")  # type: ignore[index]
    # An OpenAI client, which sends no anthropic-version, keeps OpenAI's shape.
    async with openai.AsyncOpenAI(base_url=aliased.url + "/v1", api_key="unused") as client:
        models = [model async for model in client.models.list()]
        assert [model.id for model in models] == ["tiny", "claude-alias", "third"]
        assert all(model.object == "model" and model.owned_by for model in models)


async def test_the_sdk_tool_runner_falls_back_from_threads_to_the_whole_conversation(
    tiny_model_dir: Path,
) -> None:
    asked: list[str] = []

    @beta_async_tool
    async def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: the city
        """
        asked.append(city)
        return f"sunny, 21 C in {city}"

    async with scripted_server(tiny_model_dir) as scripted, scripted.anthropic_client() as claude:
        scripted.will_reply(CALL, "It is sunny in Paris.")
        runner = claude.beta.messages.tool_runner(
            model="tiny", max_tokens=64, messages=ASK, tools=[get_weather], max_iterations=4
        )
        replies = [message async for message in runner]
        # Refused once (`thread_unsupported_request`), the runner sent every turn whole.
        assert [reply.stop_reason for reply in replies] == ["tool_use", "end_turn"]
        assert asked == ["Paris"]
        assert replies[-1].content[0].text == "It is sunny in Paris."  # type: ignore[union-attr]
        last_prompt = scripted.prompt()
        assert "What is the weather in Paris?" in last_prompt
        assert "sunny, 21 C in Paris" in last_prompt and CALL in last_prompt
        # A thread asked for directly is refused with the code the client acts on.
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(
                model="tiny", max_tokens=2, messages=USER, extra_body={"thread": {"type": "create"}}
            )
    body: Any = refused.value.body
    assert body["error"]["details"] == {"error_code": "thread_unsupported_request"}
    assert body["error"]["message"].startswith("thread: ")


async def test_a_text_document_is_read_as_the_turn_s_text(
    server: RunningServer,
) -> None:
    question = {"type": "text", "text": "What colour is the sky?"}
    as_text: Any = [
        {"role": "user", "content": "Facts\nThe sky is green.\nWhat colour is the sky?"}
    ]
    sources: list[Any] = [
        {"type": "text", "media_type": "text/plain", "data": "The sky is green."},
        {"type": "content", "content": [{"type": "text", "text": "The sky is green."}]},
        {"type": "content", "content": "The sky is green."},
    ]
    async with claude_for(server) as claude:
        expected = await claude.messages.create(
            model="tiny", max_tokens=6, messages=as_text, extra_body={"temperature": 0}
        )
        for source in sources:
            document = {"type": "document", "source": source, "title": "Facts"}
            turns: Any = [{"role": "user", "content": [document, question]}]
            counted = await claude.messages.count_tokens(model="tiny", messages=turns)
            total = expected.usage.input_tokens + (expected.usage.cache_read_input_tokens or 0)
            assert counted.input_tokens == total
            message = await claude.messages.create(
                model="tiny", max_tokens=6, messages=turns, extra_body={"temperature": 0}
            )
            assert message.content == expected.content
        refusals: list[tuple[Any, str]] = [
            (
                {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
                "messages.0.content.0.source.type: ",
            ),
            (
                {"type": "url", "url": "https://example.com/a.pdf"},
                "messages.0.content.0.source.type",
            ),
            (
                {"type": "text", "media_type": "text/html", "data": "x"},
                "messages.0.content.0.source.",
            ),
        ]
        for source, field in refusals:
            turns = [{"role": "user", "content": [{"type": "document", "source": source}]}]
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(model="tiny", max_tokens=2, messages=turns)
            assert str(refused.value.body["error"]["message"]).startswith(field)  # type: ignore[index]
        cited = {"type": "document", "source": sources[0], "citations": {"enabled": True}}
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": [cited]}]
            )
        message = str(refused.value.body["error"]["message"])  # type: ignore[index]
        assert message.startswith("messages.0.content.0.citations.enabled: ")


#: A chat template that renders an assistant turn's reasoning (as Qwen3's does).
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reasoning_template_loader(spec: str | Path | None) -> LoadedModel:
    loaded = load_model(spec)
    loaded.tokenizer._tokenizer.chat_template = REASONING_TEMPLATE
    return loaded


def thought_turns(kind: Literal["thinking", "redacted_thinking", None]) -> Any:
    """A conversation whose assistant turn holds a thinking block of `kind` (None: none), as the
    client hands an answer back (`signature` included)."""
    blocks: list[Any] = []
    if kind == "thinking":
        blocks.append({"type": "thinking", "thinking": "It is Paris, surely.", "signature": ""})
    elif kind == "redacted_thinking":
        blocks.append({"type": "redacted_thinking", "data": "opaque"})
    blocks.append({"type": "text", "text": "Paris."})
    return [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": "And of Italy?"},
    ]


async def test_thinking_handed_back_reaches_a_template_that_renders_reasoning(
    tiny_model_dir: Path,
) -> None:
    chat = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "It is Paris, surely."},
        {"role": "user", "content": "And of Italy?"},
    ]
    async with (
        running_server(
            tiny_model_dir, loader=reasoning_template_loader, served_model_names=("tiny",)
        ) as server,
        claude_for(server) as claude,
    ):
        engine = server.state.engine
        assert engine is not None

        async def counted(kind: Literal["thinking", "redacted_thinking", None]) -> int:
            turns = thought_turns(kind)
            return (await claude.messages.count_tokens(model="tiny", messages=turns)).input_tokens

        with_thought = await counted("thinking")
        assert with_thought == len(engine.prepare_chat(chat).prompt_tokens)
        assert with_thought > await counted(None) == await counted("redacted_thinking")
        message = await claude.messages.create(
            model="tiny", max_tokens=2, messages=thought_turns("thinking")
        )
        assert message.usage.output_tokens == 2
    # A template that renders no reasoning: the block is dropped, as the template would drop it.
    async with (
        running_server(tiny_model_dir, served_model_names=("tiny",)) as server,
        claude_for(server) as claude,
    ):
        plain = await claude.messages.count_tokens(model="tiny", messages=thought_turns(None))
        kept = await claude.messages.count_tokens(model="tiny", messages=thought_turns("thinking"))
        assert kept.input_tokens == plain.input_tokens


async def test_server_tools_anthropic_defined_tools_and_mcp_servers_are_refused(
    server: RunningServer,
) -> None:
    client_tool = {"name": "f", "input_schema": {"type": "object"}}
    refused_tools: list[Any] = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    ]
    async with claude_for(server) as claude:
        for tool in refused_tools:
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(
                    model="tiny", max_tokens=2, messages=USER, tools=[client_tool, tool]
                )
            message = str(refused.value.body["error"]["message"])  # type: ignore[index]
            assert message.startswith("tools.1.type: ") and tool["type"] in message
        custom = await claude.messages.create(
            model="tiny", max_tokens=2, messages=USER, tools=[{**client_tool, "type": "custom"}]
        )
        assert custom.usage.output_tokens == 2
        mcp = {"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.beta.messages.create(
                model="tiny", max_tokens=2, messages=USER, mcp_servers=[mcp]
            )
        assert str(refused.value.body["error"]["message"]).startswith("mcp_servers: ")  # type: ignore[index]
        none = await claude.messages.create(
            model="tiny", max_tokens=2, messages=USER, extra_body={"mcp_servers": []}
        )
        assert none.usage.output_tokens == 2


async def test_what_anthropic_s_clients_send_and_this_server_needs_not_leaves_the_answer(
    server: RunningServer,
) -> None:
    # What Claude-style clients send along (cache breakpoints, metadata, a service tier, beta
    # headers, thinking on a model that has no thinking tags): accepted, the answer unchanged.
    tool = {"name": "f", "description": "A tool.", "input_schema": {"type": "object"}}
    plain: Any = {
        "model": "tiny",
        "max_tokens": 6,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        "tools": [tool],
    }
    ephemeral = {"type": "ephemeral"}
    dressed: Any = {
        **plain,
        "system": [{**plain["system"][0], "cache_control": {**ephemeral, "ttl": "1h"}}],
        "messages": [
            {
                "role": "user",
                "content": [{**plain["messages"][0]["content"][0], "cache_control": ephemeral}],
            }
        ],
        "tools": [{**tool, "cache_control": ephemeral}],
        "metadata": {"user_id": "user_1"},
        "service_tier": "auto",
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_headers": {"anthropic-beta": "interleaved-thinking-2025-05-14,context-1m"},
    }
    async with claude_for(server) as claude:
        expected = await claude.messages.create(**plain, extra_body={"temperature": 0})
        answer = await claude.messages.create(**dressed, extra_body={"temperature": 0})
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content == expected.content and answer.stop_reason == expected.stop_reason
