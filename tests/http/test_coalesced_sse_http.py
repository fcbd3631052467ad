"""SSE events that are ready together go out in one body write, and what clients see is the
same, event by event.

The events of one output (its content, then at the end the finish chunk, the usage and
`[DONE]`; a Responses stream's opening events) are one `http.response.body` message: hypercorn
writes each message as one HTTP chunk, so an HTTP/1.1 client reading the chunked body with h11
sees where each write began and ended. The events themselves are the bytes the response models
write for them (the per-token templates included), and many concurrent streams deliver every
token that one stream alone does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h11
import openai
import pytest
import trio

from servers import running_server
from trio_mlx.http.anthropic.blocks import event as anthropic_event
from trio_mlx.http.anthropic.objects import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
)
from trio_mlx.http.completions import _CompletionReply
from trio_mlx.http.generation import json_string, sse, sse_event
from trio_mlx.http.objects import (
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    ResponseStreamEvent,
)
from trio_mlx.http.responses.stream import ResponseEvents
from trio_mlx.http.server import RunningServer

TRICKY = ["plain", ' "quoted" \\ \n\t', "naïve 日本 🙂 \u2028", "\x00\x1f\x7f", "", "\ud800"]
NO_EOS = {"2": -100}  # the tiny model's EOS: every stream runs to max_tokens
STREAMS = 16
MAX_TOKENS = 24


@pytest.mark.parametrize("text", TRICKY)
def test_token_templates_are_the_bytes_of_the_models(text: str) -> None:
    """The per-token events written around one encoded string (completions' text chunk, the
    Responses text delta) are what the response models give for them."""
    assert json_string(text) == json.dumps(text).encode()
    reply = _CompletionReply(
        'cmpl-"q"', 1_700_000_000, "m é", text=None, echo="", with_logprobs=False
    )  # type: ignore[arg-type]
    assert reply._text_chunk(text) == sse(reply._body(CompletionChoice(text=text)).dump())
    fast, slow = object.__new__(ResponseEvents), object.__new__(ResponseEvents)
    fast._sequence = slow._sequence = 41
    for item_id, index in (('msg_"x"', 0), ("msg_abc", 3)):
        assert fast._text_delta(item_id, index, text) == slow._event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )
    assert fast._sequence == slow._sequence == 43


async def body_writes(server: RunningServer, path: str, body: dict[str, Any]) -> list[bytes]:
    """POST `body` and read the response's chunked body with h11: one item per HTTP chunk,
    that is one item per body message the server sent (one socket write each)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    connection = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(host, int(port))
    writes: list[bytes] = []
    current = b""
    async with stream:
        request = h11.Request(
            method="POST",
            target=path,
            headers=[
                ("Host", f"{host}:{port}"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
            ],
        )
        await stream.send_all(connection.send(request) + connection.send(h11.Data(data=payload)))
        await stream.send_all(connection.send(h11.EndOfMessage()))
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.Response):
                assert event.status_code == 200
                assert (b"transfer-encoding", b"chunked") in event.headers
            elif isinstance(event, h11.Data):
                current += event.data
                if event.chunk_end:
                    writes.append(current)
                    current = b""
            elif isinstance(event, h11.EndOfMessage):
                break
    assert current == b""
    return writes


def split_events(write: bytes) -> list[bytes]:
    """The SSE events of one body write, each with its closing blank line; a write holds whole
    events only."""
    assert write.endswith(b"\n\n"), write[-40:]
    return [part + b"\n\n" for part in write.split(b"\n\n")[:-1]]


def data_of(event: bytes) -> dict[str, Any]:
    lines = event.decode().rstrip("\n").split("\n")
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert len(data) == 1, event
    return dict(json.loads(data[0]))


def chat_event_from_models(data: dict[str, Any]) -> bytes:
    """A chat chunk as the response models write it (the slow path every fast one must match)."""
    chunk = ChatCompletionChunk.model_validate(data).dump()
    for choice in chunk["choices"]:
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    return sse(chunk)


async def test_one_write_per_output_with_the_events_the_models_write(tiny_model_dir: Path) -> None:
    """Chat, completions, Responses and Messages streams: every body write is whole events;
    the last one holds everything the last output ends with; each event is the bytes the
    response models give for it."""
    async with running_server(tiny_model_dir) as server:
        base = {"max_tokens": 12, "temperature": 0.0, "logit_bias": NO_EOS, "stream": True}
        messages = [{"role": "user", "content": 'Count: ünï "quotes" \\ and 😀.'}]

        # chat: a write per output, the last one with the finish, the usage and [DONE]
        chat = {**base, "messages": messages, "stream_options": {"include_usage": True}}
        writes = await body_writes(server, "/v1/chat/completions", chat)
        events = [e for w in writes for e in split_events(w)]
        assert events[-1] == b"data: [DONE]\n\n"
        last = [data_of(e) for e in split_events(writes[-1])[:-1]]
        assert last[-1]["choices"] == [] and last[-1]["usage"]["completion_tokens"] == 12
        assert last[-2]["choices"][0]["finish_reason"] == "length"
        assert all(len(split_events(w)) == 1 for w in writes[:-1])  # a token's delta each
        for event in events[:-1]:
            assert chat_event_from_models(data_of(event)) == event
        first = data_of(events[0])["choices"][0]["delta"]
        assert first["role"] == "assistant" and first["content"]

        # completions: the same around a `text` chunk
        completion = {**base, "prompt": "Once upon", "stream_options": {"include_usage": True}}
        writes = await body_writes(server, "/v1/completions", completion)
        events = [e for w in writes for e in split_events(w)]
        assert events[-1] == b"data: [DONE]\n\n" and len(split_events(writes[-1])) >= 3
        for event in events[:-1]:
            assert sse(Completion.model_validate(data_of(event)).dump()) == event

        # Responses: the opening events in one write, the closing ones in another
        responses = {**base, "input": messages[0]["content"], "max_output_tokens": 12}
        del responses["max_tokens"], responses["logit_bias"]
        writes = await body_writes(server, "/v1/responses", responses)
        names = [[data_of(e)["type"] for e in split_events(w)] for w in writes]
        assert names[0] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert names[-1][-4:-1] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        assert names[-1][-1] in ("response.completed", "response.incomplete")
        events = [e for w in writes for e in split_events(w)]
        assert [data_of(e)["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            data = data_of(event)
            rebuilt = ResponseStreamEvent.model_validate(data).dump()
            assert sse_event(data["type"], rebuilt) == event

        # Messages: message_start alone, then one write per token, the stop events with the last
        anthropic = {**base, "messages": messages}
        del anthropic["logit_bias"]
        writes = await body_writes(server, "/v1/messages", anthropic)
        names = [[data_of(e)["type"] for e in split_events(w)] for w in writes]
        assert names[0] == ["message_start"]
        assert names[-1][-3:] == ["content_block_stop", "message_delta", "message_stop"]
        models: dict[str, Any] = {
            "message_start": MessageStartEvent,
            "content_block_start": ContentBlockStartEvent,
            "ping": PingEvent,
            "content_block_delta": ContentBlockDeltaEvent,
            "content_block_stop": ContentBlockStopEvent,
            "message_delta": MessageDeltaEvent,
            "message_stop": MessageStopEvent,
        }
        for event in (e for w in writes for e in split_events(w)):
            data = data_of(event)
            assert anthropic_event(models[data["type"]].model_validate(data)) == event


async def read_chat(
    client: openai.AsyncOpenAI, *, logprobs: bool
) -> tuple[str, list[tuple[str, float]], str | None, int]:
    """One greedy stream through the openai SDK: its content, its tokens' (token, logprob), its
    finish reason and its usage's completion tokens."""
    stream = await client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Tell me a story about a quiet lighthouse."}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logit_bias=NO_EOS,  # type: ignore[arg-type]
        logprobs=logprobs,
        top_logprobs=2 if logprobs else None,
        stream=True,
        stream_options={"include_usage": True},
    )
    content: list[str] = []
    tokens: list[tuple[str, float]] = []
    finish: str | None = None
    usage = -1
    roles = 0
    async for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage.completion_tokens
            continue
        choice = chunk.choices[0]
        roles += choice.delta.role == "assistant"
        if choice.delta.content:
            assert finish is None, "content after the finish chunk"
            content.append(choice.delta.content)
        if choice.logprobs is not None and choice.logprobs.content:
            tokens += [(t.token, t.logprob) for t in choice.logprobs.content]
        if choice.finish_reason is not None:
            assert finish is None
            finish = choice.finish_reason
    assert roles == 1
    return "".join(content), tokens, finish, usage


Read = tuple[str, list[tuple[str, float]], str | None, int]


async def read_many(client: openai.AsyncOpenAI, *, logprobs: bool) -> list[Read]:
    """`STREAMS` of `read_chat` at once."""
    results: list[Read] = []

    async def one() -> None:
        results.append(await read_chat(client, logprobs=logprobs))

    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            for _ in range(STREAMS):
                nursery.start_soon(one)
    return results


async def test_many_concurrent_streams_deliver_what_one_stream_alone_does(
    tiny_model_dir: Path,
) -> None:
    """16 greedy streams at once (one batch) give, through the openai SDK, the content and the
    per-token logprobs that the same request gives alone: nothing lost, nothing repeated."""
    async with running_server(
        tiny_model_dir, max_num_seqs=STREAMS, admission="wait", max_waiting=STREAMS
    ) as server:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            for logprobs in (False, True):
                alone = await read_chat(client, logprobs=logprobs)
                assert alone[2] == "length" and alone[3] == MAX_TOKENS and alone[0]
                assert len(alone[1]) == (MAX_TOKENS if logprobs else 0)
                together = await read_many(client, logprobs=logprobs)
                assert len(together) == STREAMS
                for content, tokens, finish, usage in together:
                    assert (content, finish, usage) == (alone[0], alone[2], alone[3])
                    assert [t for t, _ in tokens] == [t for t, _ in alone[1]]
                    for (_, lp), (_, lp_alone) in zip(tokens, alone[1], strict=True):
                        assert abs(lp - lp_alone) < 1e-4
