"""Tool use on /v1/messages with the official `anthropic` client, against the real server on a
model that writes a scripted reply (`ScriptedReplies`: the tiny model, its next tokens forced,
through the real runner, detokenizer and routes). The tiny model's chat template (SmolLM2's)
knows no tools: the tools reach it in the fallback system prompt and its calls are read in the
Hermes `<tool_call>` format, as on the OpenAI routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio

from idle import wait_until_idle
from model_wrappers import GatedModel, wrapping_loader
from runner_intake import hold_the_runner_intake
from servers import eventually, running_server
from tool_fixtures import ASK, CALL, TIME_CALL, Scripted, anthropic_tool, scripted_server
from tool_fixtures import TOOLS as CHAT_TOOLS

TOOLS: Any = [anthropic_tool(t) for t in CHAT_TOOLS]
WEATHER = TOOLS[0]
TOOL_PROMPT = "You can call functions to answer."
#: `CALL` as the forced grammar writes a single call (`tool_choice` `any` without parallel calls).
FORCED_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture
async def scripted(tiny_model_dir: Path) -> AsyncIterator[Scripted]:
    async with scripted_server(tiny_model_dir) as s:
        yield s


def without_ids(message: anthropic.types.Message) -> dict[str, Any]:
    """A message as a dict, its own id and its calls' ids (fresh for each request) left out."""
    data = message.model_dump(exclude_none=True)
    data.pop("id")
    for block in data["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return data


async def test_a_full_tool_loop_use_result_answer(scripted: Scripted) -> None:
    scripted.will_reply("Let me check.\n" + CALL, "It is sunny in Paris.")
    async with scripted.anthropic_client() as claude:
        first = await claude.messages.create(model="tiny", max_tokens=64, messages=ASK, tools=TOOLS)
        assert first.stop_reason == "tool_use"
        assert [block.type for block in first.content] == ["text", "tool_use"]
        text, call = first.content
        assert text.type == "text" and text.text == "Let me check."
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        assert call.name == "get_weather" and call.input == {"city": "Paris"}
        offered = scripted.prompt()
        assert "<tools>" in offered and '"name": "get_weather"' in offered
        assert '"description": "The current weather in a city"' in offered

        result: Any = {
            "type": "tool_result",
            "tool_use_id": call.id,
            "content": [{"type": "text", "text": '{"sky": "sunny", "c": 21}'}],
        }
        history: Any = [
            *ASK,
            {"role": "assistant", "content": first.content},  # as Anthropic's docs send it back
            {"role": "user", "content": [result]},
        ]
        second = await claude.messages.create(
            model="tiny", max_tokens=64, messages=history, tools=TOOLS
        )
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [
        ("text", "It is sunny in Paris.")
    ]
    prompt = scripted.prompt()
    # The earlier call and its result reach the model, in the format it was asked to use.
    assert "Let me check.\n" + CALL in prompt
    assert '<tool_response>\n{"sky": "sunny", "c": 21}\n</tool_response>' in prompt


async def test_a_failed_tool_result_says_so_and_text_after_results_is_kept(
    scripted: Scripted,
) -> None:
    scripted.will_reply("Sorry.")
    history: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "X"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city"},
                {"type": "text", "text": "Try again?"},
            ],
        },
    ]
    history[2]["content"][0]["is_error"] = True
    async with scripted.anthropic_client() as claude:
        reply = await claude.messages.create(
            model="tiny", max_tokens=16, messages=history, tools=TOOLS
        )
    assert reply.stop_reason == "end_turn"
    prompt = scripted.prompt()
    result = "<tool_response>\nError: no such city\n</tool_response>"
    assert '{"name": "get_weather", "arguments": {"city": "X"}}' in prompt
    assert result in prompt and prompt.index(result) < prompt.index("Try again?")


async def test_a_stream_sends_tool_use_blocks_and_equals_the_whole_answer(
    scripted: Scripted,
) -> None:
    script = "Checking both.\n" + CALL + "\n" + TIME_CALL
    scripted.will_reply(script, script)
    ask: Any = {"model": "tiny", "max_tokens": 96, "messages": ASK, "tools": TOOLS}
    async with scripted.anthropic_client() as claude:
        whole = await claude.messages.create(**ask)
        partial: dict[int, str] = {}
        async with claude.messages.stream(**ask) as stream:
            async for item in stream:
                if item.type == "content_block_delta" and item.delta.type == "input_json_delta":
                    partial[item.index] = partial.get(item.index, "") + item.delta.partial_json
            final = await stream.get_final_message()
    assert [b.type for b in whole.content] == ["text", "tool_use", "tool_use"]
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert without_ids(final) == without_ids(whole)
    calls = [b for b in final.content if b.type == "tool_use"]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].id != calls[1].id
    # The pieces of each call's input, joined, parse to its final input.
    assert json.loads(partial[1]) == {"city": "Paris"} == calls[0].input
    assert json.loads(partial.get(2) or "{}") == {} == calls[1].input


async def test_the_raw_stream_opens_a_tool_use_block_then_sends_json_pieces(
    scripted: Scripted,
) -> None:
    scripted.will_reply(CALL)
    body = {"max_tokens": 64, "messages": ASK, "tools": TOOLS, "stream": True}
    async with httpx.AsyncClient(base_url=scripted.server.url, timeout=30) as http:
        reply = await http.post("/v1/messages", json=body)
    assert reply.status_code == 200
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in reply.text.split("\n\n")[:-1]]
    names = [e["type"] for e in events]
    pieces = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * len(pieces),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[1]["content_block"]
    assert start["type"] == "tool_use" and start["input"] == {}
    assert start["name"] == "get_weather" and start["id"].startswith("toolu_")
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert not any("<tool" in piece for piece in pieces)
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


async def test_tool_choice_any_and_tool_ask_for_a_call_and_none_offers_nothing(
    scripted: Scripted,
) -> None:
    # Forced calls (`any`, `tool`) are written as the forced grammar's JSON (an array: parallel
    # calls are allowed), not in the template's markup, which the grammar refuses.
    scripted.will_reply(
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[{"name": "get_time", "arguments": {}}]',
        CALL,
        CALL,
    )
    async with scripted.anthropic_client() as claude:
        ask: Any = {"model": "tiny", "max_tokens": 64, "messages": ASK, "tools": TOOLS}
        anyone = await claude.messages.create(**ask, tool_choice={"type": "any"})
        assert "You must answer with a call of one of the functions." in scripted.prompt()
        named = await claude.messages.create(
            **ask, tool_choice={"type": "tool", "name": "get_time"}
        )
        assert "You must answer with a call of the function get_time." in scripted.prompt()
        auto = await claude.messages.create(**ask, tool_choice={"type": "auto"})
        assert TOOL_PROMPT in scripted.prompt() and "You must" not in scripted.prompt()
        none = await claude.messages.create(**ask, tool_choice={"type": "none"})
        assert TOOL_PROMPT not in scripted.prompt()
    assert anyone.stop_reason == named.stop_reason == auto.stop_reason == "tool_use"
    # (Where forcing is enforced by a grammar, the forced reply is the grammar's JSON whatever
    # the script says: what holds either way is that the calls are of the tools demanded.)
    assert {b.name for b in anyone.content if b.type == "tool_use"} <= {"get_weather", "get_time"}
    assert {b.name for b in named.content if b.type == "tool_use"} == {"get_time"}
    # Nothing offered, nothing read: the markup stays text.
    assert none.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in none.content] == [("text", CALL)]


async def test_disable_parallel_tool_use_keeps_one_call(scripted: Scripted) -> None:
    both = CALL + "\n" + TIME_CALL
    # Forced (`any`), the reply is the forced grammar's JSON (one call object: no parallel
    # calls), which refuses the Hermes markup: scripted as that JSON, so that what the reply
    # says is the script's, not the random model's own choices (which, unscripted, need not
    # close the call within `max_tokens`).
    scripted.will_reply(both, both, FORCED_CALL)
    ask: Any = {"model": "tiny", "max_tokens": 96, "messages": ASK, "tools": TOOLS}
    async with scripted.anthropic_client() as claude:
        parallel = await claude.messages.create(**ask)
        single = await claude.messages.create(
            **ask, tool_choice={"type": "auto", "disable_parallel_tool_use": True}
        )
        assert "Call at most one function at a time." in scripted.prompt()
        async with claude.messages.stream(
            **ask, tool_choice={"type": "any", "disable_parallel_tool_use": True}
        ) as stream:
            streamed = await stream.get_final_message()
        assert "one of the functions, one call only." in scripted.prompt()
    assert [b.type for b in parallel.content] == ["tool_use", "tool_use"]
    assert [(b.type, getattr(b, "name", None)) for b in single.content] == [
        ("tool_use", "get_weather")
    ]
    # Forced (`any`): one call, the one scripted.
    assert [(b.type, getattr(b, "name", None)) for b in streamed.content] == [
        ("tool_use", "get_weather")
    ]
    assert getattr(streamed.content[0], "input", None) == {"city": "Paris"}
    for message in (single, streamed):
        assert message.stop_reason == "tool_use"


async def test_count_tokens_counts_the_tools_as_the_prompt_has_them(scripted: Scripted) -> None:
    scripted.will_reply("Fine.")
    async with scripted.anthropic_client() as claude:
        bare = await claude.messages.count_tokens(model="tiny", messages=ASK)
        counted = await claude.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS)
        made = await claude.messages.create(model="tiny", max_tokens=8, messages=ASK, tools=TOOLS)
    assert counted.input_tokens > bare.input_tokens
    assert made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) == (
        counted.input_tokens
    )
    assert counted.input_tokens == len(scripted.model.prompts[-1]) + 1  # the last is fed later


async def test_tool_errors_are_400_invalid_request_naming_the_field(scripted: Scripted) -> None:
    ok: Any = {"model": "tiny", "max_tokens": 8, "messages": ASK, "tools": TOOLS}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "tool", "name": "get_moon"}}, "tool_choice.name: "),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name: "),
        ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice.type: "),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.name: "),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0."),
    ]
    async with scripted.anthropic_client() as claude:
        for change, field in cases:
            for counting in (False, True):
                args = {**ok, **change}
                with pytest.raises(anthropic.BadRequestError) as refused:
                    if counting:
                        args.pop("max_tokens")
                        await claude.messages.count_tokens(**args)
                    else:
                        await claude.messages.create(**args)
                body: Any = refused.value.body
                assert body["error"]["type"] == "invalid_request_error", change
                assert body["error"]["message"].startswith(field), (change, body)
    assert scripted.model.prompts == []  # nothing reached the model


async def test_leaving_a_tool_use_stream_aborts_it_and_frees_the_slot(scripted: Scripted) -> None:
    long_call = CALL.replace('"Paris"', json.dumps("Paris " * 150))
    scripted.will_reply(long_call, "Done.")
    engine = scripted.engine
    before = engine.get_stats()["runner"]
    ask: Any = {"model": "tiny", "max_tokens": 900, "messages": ASK, "tools": TOOLS}
    async with scripted.anthropic_client() as claude:
        async with claude.messages.stream(**ask) as stream, aclosing(stream.__aiter__()) as items:
            pieces = 0
            async for item in items:
                if item.type == "content_block_delta" and item.delta.type == "input_json_delta":
                    pieces += 1
                    if pieces == 3:
                        break  # leaving the block closes the response: the client is gone
        assert pieces == 3
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] == before["aborted"] + 1
        assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < len(
            scripted.tokenizer.encode(long_call)
        )
        with trio.fail_after(10):  # the slot is free: the next request is served at once
            after = await claude.messages.create(**{**ask, "max_tokens": 8})
    assert after.stop_reason == "end_turn"
    assert after.content[0].type == "text" and after.content[0].text == "Done."


async def test_with_batching_a_tool_stream_gone_leaves_the_message_beside_it_whole(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other: Any = {
        "model": "tiny",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Tell me about Paris."}],
        "tools": TOOLS,
        "extra_body": {"temperature": 0},
    }
    loader, made = wrapping_loader(GatedModel)
    hold = hold_the_runner_intake(monkeypatch)
    # Chunks cut by the plan alone, not by a pace measured on a busy machine: both prompts
    # prefill in one step and decode together from their first token (as the OpenAI twin in
    # test_tools_http.py).
    async with running_server(
        tiny_model_dir,
        served_model_names=("tiny",),
        max_num_seqs=2,
        loader=loader,
        prefill_chunk_seconds=60.0,
    ) as server:
        engine = server.state.engine
        assert engine is not None
        gate, held = made[0].gate, made[0].held
        async with anthropic.AsyncAnthropic(
            base_url=server.url, api_key="unused", max_retries=0, timeout=60
        ) as claude:
            alone = await claude.messages.create(**other)
            before = engine.get_stats()["runner"]
            result: dict[str, Any] = {}

            async def leaver() -> None:
                async with claude.messages.stream(**{**other, "max_tokens": 600}) as stream:
                    seen = 0
                    async for _text in stream.text_stream:
                        seen += 1
                        if seen == 3:
                            # Hold the runner mid-step, so that the other request is still
                            # decoding when this one goes.
                            held.clear()
                            gate.clear()
                            await eventually(held.is_set)
                            break
                # Gone: once the server has aborted it, the runner goes on.
                await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 1)
                gate.set()

            async def stayer() -> None:
                result["reply"] = await claude.messages.create(**other)

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    hold.close()  # the runner takes both requests at one step boundary
                    nursery.start_soon(leaver)
                    nursery.start_soon(stayer)
                    await eventually(
                        lambda: engine.get_stats()["runner"]["requests_in_flight"] == 2
                    )
                    hold.open()
            stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before["aborted"] + 1
    assert max(int(size) for size in stats["runner"]["batch_sizes"]) > 1  # they ran together
    reply = result["reply"]
    assert reply.usage.output_tokens == alone.usage.output_tokens == 40
    assert reply.content == alone.content and reply.stop_reason == alone.stop_reason


async def test_a_thinking_model_s_call_comes_after_its_thinking_block(
    tiny_model_dir: Path,
) -> None:
    async with scripted_server(tiny_model_dir, think_tags=True) as scripted:
        reply = "<think>The user wants the weather.</think>" + CALL
        scripted.will_reply(reply, reply)
        ask: Any = {"model": "tiny", "max_tokens": 64, "messages": ASK, "tools": TOOLS}
        async with scripted.anthropic_client() as claude:
            whole = await claude.messages.create(**ask)
            async with claude.messages.stream(**ask) as stream:
                final = await stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking", "tool_use"]
    thinking, call = whole.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants the weather."
    assert call.type == "tool_use" and call.input == {"city": "Paris"}
    assert whole.stop_reason == "tool_use"
    assert without_ids(final) == without_ids(whole)
