"""POST /v1/completions: text and token-id prompts, echo, logprobs, streaming framing."""

from __future__ import annotations

import httpx
import openai

from sse import chunks
from trio_mlx.http.server import RunningServer

PROMPT = "The quick brown fox"


async def test_text_prompt_matches_the_engine(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    reply = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=9, temperature=0
    )
    direct = await engine.generate(PROMPT, max_tokens=9, temperature=0)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == direct.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(engine.prepare_generate(PROMPT).prompt_tokens)
    assert reply.usage.completion_tokens == 9


async def test_token_id_prompts_and_echo(server: RunningServer, client: openai.AsyncOpenAI) -> None:
    engine = server.state.engine
    assert engine is not None
    ids = list(engine.prepare_generate(PROMPT).prompt_tokens)
    by_text = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0
    )
    for prompt in (ids, [ids]):
        by_ids = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=5, temperature=0
        )
        assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


async def test_stream_framing_and_usage(http: httpx.AsyncClient) -> None:
    whole = (
        await http.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        )
    ).json()
    response = await http.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = chunks(response.text)
    *texts, finish, usage = events
    assert len({e["id"] for e in events}) == 1 and events[0]["id"] != whole["id"]
    assert {e["object"] for e in events} == {"text_completion"}
    assert all(e["choices"][0]["finish_reason"] is None for e in texts)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in texts) == whole["choices"][0]["text"]
    assert usage["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage["usage"][key] == whole["usage"][key]


async def test_logprobs_integer_form(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 4
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.top_logprobs is not None
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
