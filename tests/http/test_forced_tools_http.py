"""`tool_choice` "required" and a named function, enforced by the forced tool-call grammar, on
/v1/chat/completions and /v1/responses, against the real server on the tiny random model (its
weights know no JSON and no tools: every valid call is the grammar's) through the official
openai client and raw HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from idle import wait_until_idle
from servers import running_server
from sse import chunks, named_events
from tool_fixtures import (
    ASK,
    FORCED_TOOLS,
    check_calls,
    leave_mid_arguments,
    parameters_by_name,
    responses_tool,
)
from trio_mlx.http.server import RunningServer

TOOLS = FORCED_TOOLS
PARAMETERS = parameters_by_name(TOOLS)
RESPONSE_TOOLS: Any = [responses_tool(t) for t in TOOLS]
CHOICES: list[tuple[Any, Any, set[str]]] = [
    # (chat tool_choice, Responses tool_choice, the functions it allows)
    ("required", "required", {"get_weather", "get_time"}),
    (
        {"type": "function", "function": {"name": "get_time"}},
        {"type": "function", "name": "get_time"},
        {"get_time"},
    ),
]
CHAT = "/v1/chat/completions"


async def streamed_chat(client: openai.AsyncOpenAI, **request: Any) -> dict[str, Any]:
    """A streamed chat completion folded up: content, calls by index (with their first delta),
    the argument fragments per call, and the finish reason."""
    stream = await client.chat.completions.create(model="tiny", stream=True, **request)
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    async for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            assert delta.function is not None
            if delta.index not in calls:
                calls[delta.index] = {"first": delta, "pieces": []}
            else:
                calls[delta.index]["pieces"].append(delta.function.arguments or "")
        finish = choice.finish_reason or finish
    return {"content": content, "calls": calls, "finish": finish}


async def test_required_and_named_give_schema_valid_calls_whole_and_streamed(
    client: openai.AsyncOpenAI,
) -> None:
    for choice, _, allowed in CHOICES:
        for parallel in (True, False):
            request: Any = {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": choice,
                "parallel_tool_calls": parallel,
                "temperature": 0,
                "max_tokens": 400,
            }
            whole = await client.chat.completions.create(model="tiny", **request)
            message = whole.choices[0].message
            assert whole.choices[0].finish_reason == "tool_calls", message
            assert message.content is None  # the call's JSON is never content
            assert message.tool_calls is not None
            made = [(c.function.name, c.function.arguments) for c in message.tool_calls]
            check_calls(made, allowed, parallel, PARAMETERS)
            assert all(
                c.id.startswith("call_") and c.type == "function" for c in message.tool_calls
            )
            assert len({c.id for c in message.tool_calls}) == len(made)

            streamed = await streamed_chat(client, **request)
            assert streamed["finish"] == "tool_calls"
            assert streamed["content"] == ""
            calls = streamed["calls"]
            assert sorted(calls) == list(range(len(calls)))
            for call in calls.values():  # index, id, type and name first, no arguments yet
                first = call["first"]
                assert first.id and first.type == "function" and first.function.name
                assert first.function.arguments == ""
            # Greedy: the same calls as the whole reply, the arguments sent in fragments.
            joined = [
                (calls[i]["first"].function.name, "".join(calls[i]["pieces"]))
                for i in sorted(calls)
            ]
            assert joined == made  # (how many pieces: as many as the reader kept up with)


async def test_forced_calls_on_the_responses_api_whole_and_streamed(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    for _, choice, allowed in CHOICES:
        for parallel in (True, False):
            request: Any = {
                "input": "What is the weather in Paris?",
                "tools": RESPONSE_TOOLS,
                "tool_choice": choice,
                "parallel_tool_calls": parallel,
                "temperature": 0,
                "max_output_tokens": 400,
            }
            whole = await client.responses.create(model="tiny", **request)
            assert whole.status == "completed"
            assert {item.type for item in whole.output} == {"function_call"}
            made = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
            check_calls(made, allowed, parallel, PARAMETERS)
            assert not whole.output_text

            reply = await http.post("/v1/responses", json={**request, "stream": True})
            events = named_events(reply.text)
            kinds = [name for name, _ in events]
            assert kinds[-1] == "response.completed"
            assert "response.output_text.delta" not in kinds
            added = [d["item"] for n, d in events if n == "response.output_item.added"]
            assert {item["type"] for item in added} == {"function_call"}
            assert all(item["arguments"] == "" and item["name"] in allowed for item in added)
            done = {
                d["item_id"]: (d["name"], d["arguments"])
                for n, d in events
                if n == "response.function_call_arguments.done"
            }
            assert [done[item["id"]] for item in added] == made
            for item in added:  # each call's arguments come in fragments of its own
                # (as many as the reader kept up with: a loaded machine merges tokens waiting)
                deltas = [
                    d["delta"]
                    for n, d in events
                    if n == "response.function_call_arguments.delta" and d["item_id"] == item["id"]
                ]
                assert deltas and "".join(deltas) == done[item["id"]][1]
            final = events[-1][1]["response"]
            assert [(o["name"], o["arguments"]) for o in final["output"]] == made


async def test_a_forced_call_cut_by_max_tokens_ends_with_length_and_no_broken_call(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    request: Any = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    full = await client.chat.completions.create(model="tiny", max_tokens=400, **request)
    assert full.usage is not None and full.choices[0].message.tool_calls is not None
    calls = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    tokens = full.usage.completion_tokens

    # Cut inside the first call: no call at all, the finish reason says why.
    early = await client.chat.completions.create(model="tiny", max_tokens=8, **request)
    assert early.choices[0].finish_reason == "length"
    assert early.choices[0].message.tool_calls is None
    assert not early.choices[0].message.content  # the partial JSON is not shown as content
    # Cut inside the last call: the complete calls before it, nothing of the cut one.
    late = await client.chat.completions.create(model="tiny", max_tokens=tokens - 3, **request)
    assert late.choices[0].finish_reason == "length"
    kept = [
        (c.function.name, c.function.arguments) for c in late.choices[0].message.tool_calls or ()
    ]
    assert kept == calls[:-1]

    # Streamed, the fragments already sent stay sent; the stream ends with "length".
    streamed = await streamed_chat(client, max_tokens=tokens - 3, **request)
    assert streamed["finish"] == "length" and streamed["content"] == ""
    got = [
        (c["first"].function.name, "".join(c["pieces"]))
        for _, c in sorted(streamed["calls"].items())
    ]
    assert got[: len(kept)] == kept
    assert len(got) == len(calls) and calls[-1][1].startswith(got[-1][1])
    assert got[-1][1] != calls[-1][1]

    # The Responses API: `incomplete`, with the complete calls only.
    responses: Any = {
        "input": "What is the weather in Paris?",
        "tools": RESPONSE_TOOLS,
        "tool_choice": "required",
        "temperature": 0,
    }
    cut = (await http.post("/v1/responses", json={**responses, "max_output_tokens": 8})).json()
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert not [o for o in cut["output"] if o["type"] == "function_call"]
    # Streamed and cut, a call's arguments are what the model wrote of them: a call cut before
    # its first argument was finished as `"{}"`, a call it never made (no client can tell it
    # from `add()` but by the item's status).
    cut_before_arguments = 0
    for limit in range(6, 13):
        body = {**responses, "max_output_tokens": limit, "stream": True}
        events = named_events((await http.post("/v1/responses", json=body)).text)
        assert events[-1][0] == "response.incomplete"
        for item in [d["item"] for n, d in events if n == "response.output_item.done"]:
            written = "".join(
                d["delta"]
                for n, d in events
                if n == "response.function_call_arguments.delta" and d["item_id"] == item["id"]
            )
            assert item["arguments"] == written, (limit, item)
            cut_before_arguments += item["status"] == "incomplete" and not written
    assert cut_before_arguments  # the case above was met


async def test_a_client_gone_mid_forced_call_frees_the_engine(server: RunningServer) -> None:
    note = {
        "type": "function",
        "function": {
            "name": "take_note",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 300, "maxLength": 300}},
                "required": ["text"],
            },
        },
    }
    engine = server.state.engine
    assert engine is not None
    before = engine.get_stats()["runner"]
    body = {
        "messages": ASK,
        "tools": [note],
        "tool_choice": {"type": "function", "function": {"name": "take_note"}},
        "parallel_tool_calls": False,
        "stream": True,
        "max_tokens": 600,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        await leave_mid_arguments(http, body)
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] == before["aborted"] + 1
        assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 300
        after = await http.post(
            CHAT, json={**body, "stream": False, "tools": TOOLS, "tool_choice": "required"}
        )
    assert after.status_code == 200
    assert after.json()["choices"][0]["finish_reason"] == "tool_calls"


async def test_with_batching_a_forced_request_leaves_plain_ones_as_alone(
    tiny_model_dir: Path,
) -> None:
    plain = [
        {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 30,
            "temperature": 0,
            "logit_bias": {"2": -100},  # no EOS: each runs its 30 tokens
        }
        for text in ("Tell me about Paris.", "Count to ten.", "Hello there")
    ]
    forced = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 400,
    }
    async with running_server(tiny_model_dir, max_num_seqs=4) as server:
        engine = server.state.engine
        assert engine is not None
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            alone = [(await http.post(CHAT, json=body)).json() for body in plain]
            forced_alone = (await http.post(CHAT, json=forced)).json()
            together: dict[int, Any] = {}

            async def send(i: int, body: dict[str, Any]) -> None:
                together[i] = (await http.post(CHAT, json=body)).json()

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send, -1, forced)
                    for i, body in enumerate(plain):
                        nursery.start_soon(send, i, body)
            stats = await wait_until_idle(engine)
    assert max(int(size) for size in stats["runner"]["batch_sizes"]) > 1  # they ran together
    for i, reply in enumerate(alone):
        assert together[i]["choices"][0]["message"] == reply["choices"][0]["message"]
        assert together[i]["usage"]["completion_tokens"] == 30
    message = together[-1]["choices"][0]["message"]
    assert together[-1]["choices"][0]["finish_reason"] == "tool_calls"
    made = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    check_calls(made, {"get_weather", "get_time"}, True, PARAMETERS)
    alone_calls = forced_alone["choices"][0]["message"]["tool_calls"]
    assert made == [(c["function"]["name"], c["function"]["arguments"]) for c in alone_calls]


async def test_a_forced_call_takes_precedence_over_response_format(http: httpx.AsyncClient) -> None:
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_object"},
        "temperature": 0,
        "max_tokens": 200,
    }
    reply = await http.post(CHAT, json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]
    check_calls(calls, {"get_weather"}, True, PARAMETERS)
    raw = chunks((await http.post(CHAT, json={**body, "stream": True})).text)
    assert raw[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_forced_tool_whose_schema_cannot_be_compiled_is_a_400(
    http: httpx.AsyncClient,
) -> None:
    broken = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "["}},
            },
        },
    }
    body = {"messages": ASK, "tools": [broken], "tool_choice": "required"}
    reply = await http.post(CHAT, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tool_choice", reply.text
    # Under "auto" nothing is compiled: the same tools are accepted.
    auto = await http.post(CHAT, json={**body, "tool_choice": "auto", "max_tokens": 4})
    assert auto.status_code == 200, auto.text


async def test_forced_arguments_are_an_object_when_the_schema_names_no_type(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    # `parameters` without `"type": "object"` (`{}` is common) let the grammar take any JSON
    # value as the arguments: the tiny model wrote a string and the call's `arguments` came back
    # as that string's text, which no client can parse. Here only `{}` is an object it allows.
    open_schema = {"maxProperties": 0, "description": "no arguments"}
    tool: Any = {"type": "function", "function": {"name": "ping", "parameters": open_schema}}
    request: Any = {
        "messages": ASK,
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 40,
    }
    whole = await client.chat.completions.create(model="tiny", **request)
    assert whole.choices[0].finish_reason == "tool_calls", whole
    (call,) = whole.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {}
    streamed = await streamed_chat(client, **request)
    assert streamed["finish"] == "tool_calls"
    first = streamed["calls"][0]
    assert json.loads(first["first"].function.arguments + "".join(first["pieces"])) == {}
    reply = await client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[responses_tool(tool)],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=40,
    )
    assert reply.status == "completed", reply
    assert [json.loads(o.arguments) for o in reply.output if o.type == "function_call"] == [{}]
    # A schema of another type is refused, naming it where the request has it.
    strings = {"type": "string"}
    refused = await http.post(
        CHAT,
        json={**request, "tools": [{**tool, "function": {"name": "ping", "parameters": strings}}]},
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "tools[0].function.parameters.type"
    flat = {"type": "function", "name": "ping", "parameters": strings}
    refused = await http.post(
        "/v1/responses", json={"input": "hi", "tools": [flat], "tool_choice": "required"}
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "tools[0].parameters.type"


async def test_a_forced_call_a_stop_string_cuts_is_no_completed_call(
    http: httpx.AsyncClient,
) -> None:
    # A stop string met inside the call's JSON: the streamed Responses call was "completed"
    # with its broken arguments (`{"`), a call a client would run; chat ends with "stop" and
    # no call, as the whole response has none.
    tool = {
        "type": "function",
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    }
    body: Any = {
        "input": "What time is it?",
        "tools": [tool],
        "tool_choice": "required",
        "stop": ["zone"],
        "temperature": 0,
        "max_output_tokens": 60,
    }
    whole = (await http.post("/v1/responses", json=body)).json()
    assert not [o for o in whole["output"] if o["type"] == "function_call"], whole
    events = named_events((await http.post("/v1/responses", json={**body, "stream": True})).text)
    calls = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert calls and all(c["type"] == "function_call" for c in calls)
    assert calls[-1]["status"] == "incomplete", calls
    with pytest.raises(ValueError):
        json.loads(calls[-1]["arguments"])
    final = events[-1][1]["response"]
    assert final["output"][-1]["status"] == "incomplete"
