"""Function calling against the real server with the official openai client: a model that writes
a scripted reply (`ScriptedReplies`: the tiny model, its next tokens forced) through the real
runner, detokenizer and routes. The tiny model's chat template (SmolLM2's) knows no tools, so
these also cover the fallback system prompt and the Hermes `<tool_call>` format."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from websockets.sync.client import connect

from idle import wait_until_idle
from model_wrappers import GatedModel, wrapping_loader
from runner_intake import hold_the_runner_intake
from servers import eventually, running_server
from sse import chunks, named_events
from tool_fixtures import (
    ASK,
    CALL,
    TIME_CALL,
    TOOLS,
    Scripted,
    leave_mid_arguments,
    responses_tool,
    scripted_server,
)

RESPONSE_TOOLS: Any = [responses_tool(t) for t in TOOLS]


@pytest.fixture
async def scripted(tiny_model_dir: Path) -> AsyncIterator[Scripted]:
    async with scripted_server(tiny_model_dir) as s:
        yield s


async def test_a_full_tool_loop_call_result_answer(scripted: Scripted) -> None:
    scripted.will_reply("Let me check.\n" + CALL, "It is sunny in Paris.")
    async with scripted.openai_client() as client:
        first = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        offered = scripted.prompt()
        assert "<tools>" in offered and '"name": "get_weather"' in offered

        messages: Any = [
            *ASK,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "c": 21}'},
        ]
        second = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].message.tool_calls is None
    history = scripted.prompt()
    # The earlier call and its result reach the model, in the format it was asked to use.
    assert CALL in history
    assert '<tool_response>\n{"sky": "sunny", "c": 21}\n</tool_response>' in history


async def test_streamed_calls_come_as_tool_call_deltas(scripted: Scripted) -> None:
    scripted.will_reply("Checking both.\n" + CALL + "\n" + TIME_CALL)
    async with scripted.openai_client() as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, stream=True
        )
        content = ""
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        first_deltas: list[Any] = []
        async for chunk in stream:
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    first_deltas.append(delta)
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
                calls[delta.index]["args"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert content == "Checking both."
    assert finish == "tool_calls"
    for delta in first_deltas:  # index, id, type and name first, with empty arguments
        assert delta.id and delta.type == "function" and delta.function.name
        assert delta.function.arguments == ""
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["args"]) == {"city": "Paris"}
    assert json.loads(calls[1]["args"]) == {}
    assert calls[0]["id"] != calls[1]["id"]


async def test_raw_stream_never_shows_markup_and_arguments_come_in_pieces(
    scripted: Scripted,
) -> None:
    scripted.will_reply(CALL)
    async with httpx.AsyncClient(base_url=scripted.server.url, timeout=30) as http:
        reply = await http.post(
            "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "stream": True}
        )
    events = chunks(reply.text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert not any("<tool" in (d.get("content") or "") for d in deltas)
    pieces = [
        d["tool_calls"][0]["function"]["arguments"]
        for d in deltas
        if "tool_calls" in d and "id" not in d["tool_calls"][0]
    ]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_parallel_tool_calls_false_keeps_only_the_first(scripted: Scripted) -> None:
    scripted.will_reply(CALL + "\n" + TIME_CALL, CALL + "\n" + TIME_CALL)
    async with scripted.openai_client() as client:
        whole = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False
        )
        stream = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False, stream=True
        )
        indexes = {d.index async for c in stream for d in c.choices[0].delta.tool_calls or ()}
    assert whole.choices[0].message.tool_calls is not None
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_weather"]
    assert indexes == {0}


async def test_tool_choice_none_offers_nothing_and_parses_nothing(scripted: Scripted) -> None:
    scripted.will_reply(CALL)
    async with scripted.openai_client() as client:
        reply = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="none"
        )
    assert "<tools>" not in scripted.prompt()
    assert reply.choices[0].message.content == CALL
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


async def test_tool_choice_required_and_named_are_checked_and_stated(scripted: Scripted) -> None:
    async with scripted.openai_client() as client:
        for bad in (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            {"tool_choice": "required"},
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="tiny", messages=ASK, **bad)
            assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
        # Forced calls are written as the grammar's JSON (an array: parallel calls are allowed),
        # not in the template's markup.
        scripted.will_reply(
            '[{"name": "get_time", "arguments": {}}]',
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        )
        named = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        assert "You must answer with a call of the function get_time." in scripted.prompt()
        required = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required"
        )
        assert "You must answer with a call of one of the functions." in scripted.prompt()
    assert named.choices[0].message.tool_calls is not None
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.content is None
    assert required.choices[0].message.tool_calls is not None
    assert json.loads(required.choices[0].message.tool_calls[0].function.arguments) == {
        "city": "Paris"
    }


async def test_responses_function_call_loop(scripted: Scripted) -> None:
    scripted.will_reply(CALL, "Sunny.")
    async with scripted.openai_client() as client:
        first = await client.responses.create(
            model="tiny", input="What is the weather in Paris?", tools=RESPONSE_TOOLS
        )
        assert first.status == "completed"
        assert [item.type for item in first.output] == ["function_call"]
        call = first.output[0]
        assert call.type == "function_call"
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.status == "completed"
        second = await client.responses.create(
            model="tiny",
            tools=RESPONSE_TOOLS,
            input=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            ],
        )
    assert second.output_text == "Sunny."
    assert "<tool_response>\nsunny\n</tool_response>" in scripted.prompt()
    assert '"name": "get_weather"' in scripted.prompt().split("<|im_start|>assistant")[1]


async def test_responses_streams_function_call_events(scripted: Scripted) -> None:
    scripted.will_reply("On it." + CALL)
    async with httpx.AsyncClient(base_url=scripted.server.url, timeout=30) as http:
        reply = await http.post(
            "/v1/responses",
            json={"input": "Weather?", "tools": RESPONSE_TOOLS, "stream": True},
        )
    events = named_events(reply.text)
    kinds = [name for name, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    added = [data for name, data in events if name == "response.output_item.added"]
    assert [a["item"]["type"] for a in added] == ["message", "function_call"]
    call = added[1]["item"]
    assert (
        added[1]["output_index"] == 1 and call["arguments"] == "" and call["name"] == "get_weather"
    )
    deltas = [d for n, d in events if n == "response.function_call_arguments.delta"]
    assert all(d["item_id"] == call["id"] and d["output_index"] == 1 for d in deltas)
    done = next(d for n, d in events if n == "response.function_call_arguments.done")
    assert done["arguments"] == "".join(d["delta"] for d in deltas)
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    item_done = [d for n, d in events if n == "response.output_item.done"]
    assert [d["item"]["type"] for d in item_done] == ["message", "function_call"]
    assert item_done[1]["item"]["status"] == "completed"
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output_text"] == "On it."
    assert [s["sequence_number"] for _, s in events] == list(range(len(events)))


async def test_responses_logprobs_are_the_texts_tokens_not_the_calls(scripted: Scripted) -> None:
    # The reply's tokens write a message, then a call: the message's logprobs are the tokens of
    # its text, whole and streamed, not the call's markup nor the end-of-sequence token after it.
    reply = "On it." + CALL
    body = {
        "input": "Weather?",
        "tools": RESPONSE_TOOLS,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    scripted.will_reply(reply, reply)
    async with scripted.openai_client() as client:
        whole = await client.responses.create(model="tiny", **body)  # type: ignore[arg-type]
        assert [item.type for item in whole.output] == ["message", "function_call"]
        part = whole.output[0].content[0]  # type: ignore[union-attr]
        assert part.text == "On it." and part.logprobs is not None  # type: ignore[union-attr]
        tokens = [item.token for item in part.logprobs]  # type: ignore[union-attr]
        # This tokenizer writes ".<" as one token: a token that begins in the text goes with it.
        assert tokens == ["On", " it", ".<"]
        assert all(len(item.top_logprobs) == 2 for item in part.logprobs)  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=scripted.server.url, timeout=30) as http:
            streamed = await http.post("/v1/responses", json={**body, "stream": True})
    events = named_events(streamed.text)
    assert [
        t["token"] for n, d in events if n == "response.output_text.delta" for t in d["logprobs"]
    ] == tokens
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert [t["token"] for t in final["output"][0]["content"][0]["logprobs"]] == tokens


async def test_responses_websocket_sends_function_call_events(scripted: Scripted) -> None:
    scripted.will_reply(CALL)
    url = scripted.server.url.replace("http://", "ws://") + "/v1/responses"

    def session() -> list[dict[str, Any]]:
        seen = []
        with connect(url) as ws:
            ws.send(json.dumps({"type": "response.create", "input": "Hi", "tools": RESPONSE_TOOLS}))
            while not seen or seen[-1]["type"] != "response.completed":
                seen.append(json.loads(ws.recv(timeout=10)))
        return seen

    events = await trio.to_thread.run_sync(session)
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.done" in kinds
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["function_call"]


async def test_client_gone_in_the_middle_of_a_call_frees_the_engine(scripted: Scripted) -> None:
    long_value = " ".join(["word"] * 400)
    scripted.will_reply(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + long_value + '"}}'
    )
    engine = scripted.engine
    before = engine.get_stats()["runner"]
    body = {"messages": ASK, "tools": TOOLS, "stream": True, "max_tokens": 600}
    async with httpx.AsyncClient(base_url=scripted.server.url, timeout=30) as http:
        await leave_mid_arguments(http, body)
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] == before["aborted"] + 1
        assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 400
        scripted.will_reply(TIME_CALL)
        reply = await http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


async def test_bad_tools_and_items_on_responses_are_400s_naming_the_field(
    scripted: Scripted,
) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": [{"type": "message", "content": "hi"}]}, "input[0].role"),
        (
            {
                "input": "hi",
                "tools": RESPONSE_TOOLS,
                "tool_choice": {"type": "function", "name": "x"},
            },
            "tool_choice",
        ),
    ]
    async with httpx.AsyncClient(base_url=scripted.server.url, timeout=30) as http:
        for body, param in cases:
            reply = await http.post("/v1/responses", json=body)
            assert reply.status_code == 400, (body, reply.text)
            assert reply.json()["error"]["param"] == param, reply.text
        chat = await http.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
                    },
                ]
            },
        )
    assert chat.status_code == 400
    assert chat.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


async def test_with_batching_a_tool_stream_gone_leaves_the_other_request_whole(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader, made = wrapping_loader(GatedModel)
    hold = hold_the_runner_intake(monkeypatch)
    # Chunks cut by the plan alone, not by a pace measured on a busy machine: both prompts
    # prefill in one step and decode together from their first token.
    async with running_server(
        tiny_model_dir, loader=loader, max_num_seqs=2, prefill_chunk_seconds=60.0
    ) as server:
        engine = server.state.engine
        assert engine is not None
        gate, held = made[0].gate, made[0].held
        other = {
            "messages": [{"role": "user", "content": "Tell me about Paris."}],
            "tools": TOOLS,
            "max_tokens": 40,
            "temperature": 0,
            "logit_bias": {"2": -100},  # no EOS: it runs its 40 tokens
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            alone = (await http.post("/v1/chat/completions", json=other)).json()
            before = engine.get_stats()["runner"]
            result: dict[str, Any] = {}

            async def leaver() -> None:
                body = {**other, "max_tokens": 600, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    seen = 0
                    async for line in response.aiter_lines():
                        seen += line.startswith("data: {")
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
                result["reply"] = (await http.post("/v1/chat/completions", json=other)).json()

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
        assert reply["usage"]["completion_tokens"] == 40
        assert reply["choices"][0]["message"] == alone["choices"][0]["message"]


async def test_the_reasoning_split_still_applies_before_a_call(tiny_model_dir: Path) -> None:
    async with scripted_server(tiny_model_dir, think_tags=True) as scripted:
        reply = "<think>The user wants the weather.</think>" + CALL
        scripted.will_reply(reply, reply)
        async with httpx.AsyncClient(base_url=scripted.server.url, timeout=30) as http:
            body = {"messages": ASK, "tools": TOOLS}
            whole = (await http.post("/v1/chat/completions", json=body)).json()
            streamed = chunks(
                (await http.post("/v1/chat/completions", json={**body, "stream": True})).text
            )
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    deltas = [e["choices"][0]["delta"] for e in streamed]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the weather."
    assert "".join(d.get("content", "") for d in deltas) == ""
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
