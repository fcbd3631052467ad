"""POST /v1/responses and its WebSocket mode, through the openai client."""

from __future__ import annotations

import json

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
    assert response.object == "response" and response.id.startswith("resp-")
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
