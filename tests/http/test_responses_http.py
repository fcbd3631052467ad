"""POST /v1/responses and its WebSocket mode, through the openai client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import trio
from websockets.sync.client import connect

from sse import named_events
from trio_mlx.http.server import RunningServer

INSTRUCTIONS = "You are terse."
QUESTION = "Name a colour."
MESSAGES = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": QUESTION},
]


async def expected_text(server: RunningServer, max_tokens: int) -> str:
    assert server.state.engine is not None
    out = await server.state.engine.chat(MESSAGES, max_tokens=max_tokens, temperature=0)
    return out.text


async def test_text_input_with_instructions(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    response = await client.responses.create(
        model="tiny",
        instructions=INSTRUCTIONS,
        input=QUESTION,
        max_output_tokens=8,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")  # as OpenAI's
    assert [item.id[:4] for item in response.output] == ["msg_"]
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == await expected_text(server, 8)
    assert response.usage is not None and response.usage.output_tokens == 8


async def test_input_items(server: RunningServer, client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model="tiny",
        input=[
            {"role": "developer", "content": INSTRUCTIONS},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}],
            },
        ],
        max_output_tokens=6,
        temperature=0,
    )
    assert response.output_text == await expected_text(server, 6)


async def test_streaming_events(server: RunningServer, http: httpx.AsyncClient) -> None:
    raw = await http.post(
        "/v1/responses",
        json={
            "model": "tiny",
            "instructions": INSTRUCTIONS,
            "input": QUESTION,
            "max_output_tokens": 7,
            "temperature": 0,
            "stream": True,
        },
    )
    events = named_events(raw.text)
    names = [name for name, _ in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert all(data["type"] == name for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert deltas == await expected_text(server, 7)
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == deltas


async def test_openai_client_stream(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=20, temperature=0, stream=True
    )
    kinds = []
    async with stream:
        async for event in stream:
            kinds.append(event.type)
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")


async def test_websocket_mode_several_responses_and_errors(server: RunningServer) -> None:
    expected = await expected_text(server, 5)

    def session() -> list[list[dict[str, object]]]:
        sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        results: list[list[dict[str, object]]] = []
        with sync.responses.connect() as connection:
            for request in (
                {
                    "model": "tiny",
                    "instructions": INSTRUCTIONS,
                    "input": QUESTION,
                    "max_output_tokens": 5,
                    "temperature": 0,
                },
                {"model": "no-such-model", "input": QUESTION},
                {
                    "model": "tiny",
                    "instructions": INSTRUCTIONS,
                    "input": QUESTION,
                    "max_output_tokens": 5,
                    "temperature": 0,
                },
            ):
                connection.send({"type": "response.create", **request})  # type: ignore[arg-type]
                events: list[dict[str, object]] = []
                for event in connection:
                    events.append(event.to_dict())
                    if event.type in ("response.completed", "response.incomplete", "error"):
                        break
                results.append(events)
        return results

    first, refused, third = await trio.to_thread.run_sync(session)
    for events in (first, third):
        deltas = "".join(
            str(e["delta"]) for e in events if e["type"] == "response.output_text.delta"
        )
        assert deltas == expected
        assert events[-1]["type"] == "response.incomplete"
    assert len(refused) == 1 and refused[0]["type"] == "error"
    assert refused[0]["error"]["code"] == "model_not_found"  # type: ignore[index]


async def test_websocket_bad_messages_keep_the_connection(server: RunningServer) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/responses"

    def session() -> list[dict[str, object]]:
        answers = []
        with connect(url) as ws:
            for message in (
                "not json",
                "[1]",
                json.dumps({"type": "nope"}),
                json.dumps({"type": "response.create", "input": 3}),
            ):
                ws.send(message)
                answers.append(json.loads(ws.recv(timeout=10)))
            ws.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 2}))
            while True:
                event = json.loads(ws.recv(timeout=10))
                if (
                    event["type"].startswith("response.")
                    and "response" in event
                    and event["response"]["status"] != "in_progress"
                ):
                    answers.append(event)
                    return answers

    answers = await trio.to_thread.run_sync(session)
    assert [a["type"] for a in answers[:4]] == ["error"] * 4
    assert answers[2]["error"]["param"] == "type"  # type: ignore[index]
    assert answers[3]["error"]["param"] == "input"  # type: ignore[index]
    assert answers[4]["type"] == "response.incomplete"


# ---- include: ["message.output_text.logprobs"] and top_logprobs ---------------------------------

LOGPROBS = "message.output_text.logprobs"


def token_rows(items: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Logprob items (chat's, a part's, an event's) as (token, logprob, [(token, logprob)])."""
    return [(i.token, i.logprob, [(t.token, t.logprob) for t in i.top_logprobs]) for i in items]


async def chat_logprobs(client: openai.AsyncOpenAI, max_tokens: int, **extra: Any) -> Any:
    """The chat route's answer to the same greedy prompt, with 3 alternatives a token."""
    chat = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        **extra,
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    return chat.choices[0].logprobs.content


async def test_output_text_logprobs_are_the_chat_routes_whole_and_streamed(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    request: Any = {
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "max_output_tokens": 8,
        "temperature": 0,
        "include": [LOGPROBS],
        "top_logprobs": 3,
    }
    chat = await chat_logprobs(client, 8)
    whole = await client.responses.create(**request)
    assert whole.top_logprobs == 3
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert part.text == await expected_text(server, 8)
    # The chat route's logprobs for the same tokens, bytes included.
    assert token_rows(part.logprobs) == token_rows(chat)
    assert [p.bytes for p in part.logprobs] == [c.bytes for c in chat]
    assert len(part.logprobs) == 8 and "".join(p.token for p in part.logprobs) == part.text
    for item in part.logprobs:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy: the most likely one
        assert item.bytes == list(item.token.encode())
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)

    stream = await client.responses.create(**request, stream=True)
    deltas = []
    async with stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                assert "".join(t.token for t in event.logprobs) == event.delta
                deltas += event.logprobs
            elif event.type == "response.output_text.done":
                done = event
            elif event.type == "response.content_part.done":
                streamed_part = event.part
            elif event.type == "response.incomplete":
                final = event.response
    # Each delta carries its own tokens; the done event, the part and the final response all.
    assert token_rows(deltas) == token_rows(chat)
    assert token_rows(done.logprobs) == token_rows(chat)
    assert streamed_part.type == "output_text" and streamed_part.logprobs is not None
    assert token_rows(streamed_part.logprobs) == token_rows(chat)
    final_part = final.output[0].content[0]  # type: ignore[union-attr]
    assert final_part.logprobs == part.logprobs  # type: ignore[union-attr]


async def test_logprobs_without_alternatives_and_not_included(client: openai.AsyncOpenAI) -> None:
    request: Any = {"model": "tiny", "input": QUESTION, "max_output_tokens": 4, "temperature": 0}
    bare = await client.responses.create(**request, include=[LOGPROBS])
    part = bare.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == 4  # type: ignore[union-attr]
    assert all(item.top_logprobs == [] for item in part.logprobs)  # type: ignore[union-attr]
    left_out = await client.responses.create(**request)
    assert left_out.output[0].content[0].logprobs is None  # type: ignore[union-attr]
    assert left_out.output_text == bare.output_text
    stream = await client.responses.create(**request, stream=True)
    async with stream:
        async for event in stream:
            if event.type in ("response.output_text.delta", "response.output_text.done"):
                assert event.logprobs == []


async def test_logprobs_of_a_reply_a_stop_string_ended(
    server: RunningServer, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    # The stop string is the 4th token's text: the reply is the first 3 tokens' text; the 4th
    # token is in the logprobs, as in chat's, with the tokens that came before.
    chat_all = await chat_logprobs(client, 8)
    stop = chat_all[3].token
    assert stop.strip() and stop not in "".join(t.token for t in chat_all[:3])
    chat = await chat_logprobs(client, 8, stop=[stop])
    assert token_rows(chat) == token_rows(chat_all[:4])
    body = {
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "max_output_tokens": 8,
        "temperature": 0,
        "stop": [stop],
        "include": [LOGPROBS],
        "top_logprobs": 3,
    }
    whole = (await http.post("/v1/responses", json=body)).json()
    part = whole["output"][0]["content"][0]
    assert whole["status"] == "completed"
    assert part["text"] == "".join(t.token for t in chat_all[:3])
    rows = [
        (p["token"], p["logprob"], [(t["token"], t["logprob"]) for t in p["top_logprobs"]])
        for p in part["logprobs"]
    ]
    assert rows == token_rows(chat)
    events = named_events((await http.post("/v1/responses", json={**body, "stream": True})).text)
    sent = [t for n, d in events if n == "response.output_text.delta" for t in d["logprobs"]]
    # The deltas carry the tokens of the text they send; the stop string's token made none, so
    # only the done event (and the part, and the response) has it.
    assert [t["token"] for t in sent] == [t.token for t in chat_all[:3]]
    done = next(d for n, d in events if n == "response.output_text.done")
    assert [t["token"] for t in done["logprobs"]] == [t.token for t in chat_all[:4]]
    assert events[-1][1]["response"]["output"][0]["content"][0] == part


async def test_logprobs_fields_are_checked(http: httpx.AsyncClient) -> None:
    for body, param in (
        ({"top_logprobs": 21, "include": [LOGPROBS]}, "top_logprobs"),
        ({"top_logprobs": -1, "include": [LOGPROBS]}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # alternatives of logprobs not included
        ({"top_logprobs": 2, "include": ["reasoning.encrypted_content"]}, "top_logprobs"),
        ({"include": ["message.output_text.nope"]}, "include[0]"),
        ({"include": LOGPROBS}, "include"),
    ):
        reply = await http.post("/v1/responses", json={"input": "hi", **body})
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["param"] == param, reply.text
    # Includes this server has nothing for (no such items are made) are accepted.
    reply = await http.post(
        "/v1/responses",
        json={"input": "hi", "max_output_tokens": 2, "include": ["reasoning.encrypted_content"]},
    )
    assert reply.status_code == 200, reply.text
    assert "logprobs" not in reply.json()["output"][0]["content"][0]


async def test_websocket_mode_sends_logprobs(server: RunningServer) -> None:
    expected = await expected_text(server, 5)

    def session() -> list[dict[str, Any]]:
        sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        events: list[dict[str, Any]] = []
        with sync.responses.connect() as connection:
            connection.send(
                {
                    "type": "response.create",
                    "model": "tiny",
                    "instructions": INSTRUCTIONS,
                    "input": QUESTION,
                    "max_output_tokens": 5,
                    "temperature": 0,
                    "include": [LOGPROBS],
                    "top_logprobs": 2,
                }  # type: ignore[typeddict-unknown-key]
            )
            for event in connection:
                events.append(event.to_dict())
                if event.type in ("response.completed", "response.incomplete", "error"):
                    break
        return events

    events = await trio.to_thread.run_sync(session)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    tokens = [t for e in deltas for t in e["logprobs"]]
    assert "".join(t["token"] for t in tokens) == expected
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in tokens)
    final = events[-1]["response"]["output"][0]["content"][0]
    assert [t["token"] for t in final["logprobs"]] == [t["token"] for t in tokens]


# ---- POST /v1/responses/input_tokens ------------------------------------------------------------


async def test_input_tokens_count_the_prompt_a_response_prefills(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    # The route was a 404: `client.responses.input_tokens.count` could not be used.
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    prompts: list[dict[str, Any]] = [
        {"input": QUESTION},
        {"instructions": INSTRUCTIONS, "input": QUESTION},
        {"input": [{"role": "developer", "content": INSTRUCTIONS}, *MESSAGES[1:]]},
        {"input": QUESTION, "tools": [weather]},
        {"input": QUESTION, "tools": [weather], "tool_choice": "required"},
    ]
    counts = []
    for prompt in prompts:
        counted = await client.responses.input_tokens.count(model="tiny", **prompt)
        assert counted.object == "response.input_tokens"
        created = await client.responses.create(model="tiny", max_output_tokens=1, **prompt)
        assert created.usage is not None
        assert counted.input_tokens == created.usage.input_tokens, prompt
        counts.append(counted.input_tokens)
    plain, instructed, as_items, offered, forced = counts
    assert as_items == instructed  # instructions are a system turn, as a developer item is
    # (the template's own system prompt when none is given is longer than INSTRUCTIONS)
    assert plain != instructed and plain < offered < forced  # the tools' prompt, the forcing
    alone = await client.responses.input_tokens.count(model="tiny", instructions=INSTRUCTIONS)
    assert 0 < alone.input_tokens < instructed  # the system turn alone
    for body, param in (
        ({}, "input"),
        ({"input": QUESTION, "previous_response_id": "resp-1"}, "previous_response_id"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": QUESTION, "tools": [weather], "tool_choice": "nope"}, "tool_choice"),
    ):
        reply = await http.post("/v1/responses/input_tokens", json=body)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["param"] == param, reply.text
