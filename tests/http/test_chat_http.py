"""POST /v1/chat/completions over the real server and the real openai client."""

from __future__ import annotations

import httpx
import openai
import trio

from sse import chunks
from trio_mlx.http.server import RunningServer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def engine_of(server: RunningServer):
    assert server.state.engine is not None
    return server.state.engine


async def test_chat_completion_matches_the_engine(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    reply = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
    )
    direct = await engine_of(server).chat(MESSAGES, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "tiny"
    assert reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == direct.text
    assert choice.finish_reason == "length"
    prompt = engine_of(server).prepare_chat(MESSAGES).prompt_tokens
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == direct.completion_tokens == 12
    assert reply.usage.total_tokens == len(prompt) + 12


async def test_stream_framing_chunk_by_chunk(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    body = {
        "model": "tiny-alias",
        "messages": MESSAGES,
        "max_completion_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = chunks(response.text)
    first, *middle, finish, usage = events
    assert {e["id"] for e in events} == {first["id"]}
    assert {e["created"] for e in events} == {first["created"]}
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert {e["model"] for e in events} == {"tiny-alias"}
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["delta"]["content"], "the first chunk already carries content"
    for event in middle:
        assert set(event["choices"][0]["delta"]) == {"content"}
        assert event["choices"][0]["finish_reason"] is None
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 10
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in [first, *middle])
    direct = await engine_of(server).chat(MESSAGES, max_tokens=10, temperature=0)
    assert text == direct.text
    assert usage["usage"]["prompt_tokens"] == direct.prompt_tokens


async def test_stream_without_usage_and_with_empty_stream_options(
    http: httpx.AsyncClient,
) -> None:
    for options in (None, {}):
        body = {"messages": MESSAGES, "max_tokens": 3, "stream": True, "temperature": 0}
        if options is not None:
            body["stream_options"] = options
        response = await http.post("/v1/chat/completions", json=body)
        events = chunks(response.text)
        assert all(e["choices"] for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_client_streams(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    async with stream:
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert usage is not None and usage.completion_tokens == 6
    assert "".join(pieces)


async def test_sync_client_in_a_thread(server: RunningServer) -> None:
    def call() -> str | None:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as sync:
            reply = sync.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=5, temperature=0
            )
            return reply.choices[0].message.content

    text = await trio.to_thread.run_sync(call)
    direct = await engine_of(server).chat(MESSAGES, max_tokens=5, temperature=0)
    assert text == direct.text


async def test_seed_reproduces_sampling(client: openai.AsyncOpenAI) -> None:
    async def sample(seed: int) -> str | None:
        reply = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=seed
        )
        return reply.choices[0].message.content

    first = await sample(7)
    assert await sample(7) == first
    others = {await sample(s) for s in (8, 9, 10)}
    assert others != {first}


async def test_stop_strings_end_the_text(server: RunningServer, client: openai.AsyncOpenAI) -> None:
    free = await engine_of(server).chat(MESSAGES, max_tokens=16, temperature=0)
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop
    for stops in (stop, [stop, "never-appears"]):
        reply = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=stops
        )
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.content == free.text[: free.text.index(stop)]


async def test_content_parts_and_developer_role(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    reply = await client.chat.completions.create(
        model="tiny", messages=parts, max_tokens=8, temperature=0, user="someone"
    )
    direct = await engine_of(server).chat(MESSAGES, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == direct.text


async def test_logprobs_shape(server: RunningServer, client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    direct = await engine_of(server).chat(
        MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    assert direct.logprobs is not None
    for item, expected in zip(content, direct.logprobs, strict=True):
        assert abs(item.logprob - expected.logprob) < 1e-5
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert bytes(item.bytes or []).decode("utf-8", "replace") == item.token
    assert "".join(i.token for i in content) == reply.choices[0].message.content


async def test_streamed_logprobs_cover_every_token(http: httpx.AsyncClient) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
    }
    events = chunks((await http.post("/v1/chat/completions", json=body)).text)
    tokens = [
        item
        for e in events
        for item in ((e["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert len(tokens) == 6
    assert all(set(t) == {"token", "logprob", "bytes", "top_logprobs"} for t in tokens)


def test_delta_chunks_are_the_bytes_the_models_build() -> None:
    """The per-token fast path (`_delta_chunk`) writes what `ChatCompletionChunk` would."""
    from trio_mlx.http.chat import _ChatReply
    from trio_mlx.http.objects import ChatDelta

    reply = _ChatReply('chatcmpl-"q"', 1_700_000_000, 'tiny "alias" é', text=None)  # type: ignore[arg-type]
    for role, content, reasoning in [
        (True, "Hello", ""),
        (False, ' "quoted" \\ \n tab\t', ""),
        (False, "ünï 😀 \u2028", "thinking…"),
        (True, "", "only reasoning"),
    ]:
        delta = ChatDelta(
            role="assistant" if role else None,
            content=content or None,
            reasoning_content=reasoning or None,
        )
        assert reply._delta_chunk(role, content, reasoning) == reply._chunk(delta)
