"""POST /v1/messages and /v1/messages/count_tokens over the real server, through the official
`anthropic` client (and raw HTTP where the client would hide the bytes): answers equal the
engine's own, streams equal their final message, stop reasons, prefill, thinking blocks, and
every error in Anthropic's shape with the OpenAI routes' status codes."""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import pydantic
import pytest
import trio

from media_samples import png
from model_wrappers import FaultyModel, GatedModel, ScriptedModel, wrapping_loader
from servers import eventually, running_server
from trio_mlx.actors.engine import Engine
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.http.server import RunningServer

SYSTEM = "You are terse."
USER = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}  # not a keyword of the client's create(): sent as extra_body
PNG_BLOCK = {
    "type": "image",
    "source": {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png(0)).decode(),
    },
}


def claude_for(server: RunningServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=30
    )


@pytest.fixture
async def claude(server: RunningServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with claude_for(server) as client:
        yield client


def engine_of(server: RunningServer) -> Engine:
    assert server.state.engine is not None
    return server.state.engine


def sse_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """`(event name, data)` of each event of a raw SSE body; every event has both lines."""
    assert body.endswith("\n\n")
    out = []
    for block in body.split("\n\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) == {"event", "data"}, block
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_a_message_equals_the_engine_answer(
    server: RunningServer, claude: anthropic.AsyncAnthropic
) -> None:
    message = await claude.messages.create(
        model="tiny", max_tokens=12, system=SYSTEM, messages=USER, extra_body=GREEDY
    )
    chat = [{"role": "system", "content": SYSTEM}, *USER]
    direct = await engine_of(server).chat(chat, max_tokens=12, temperature=0)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "tiny"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == direct.text
    assert direct.completion_tokens == 12
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    prompt = len(engine_of(server).prepare_chat(chat).prompt_tokens)
    usage = message.usage
    assert usage.output_tokens == 12
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt
    assert usage.cache_creation_input_tokens == 0


async def test_cached_prompt_tokens_are_reported_as_cache_reads(
    claude: anthropic.AsyncAnthropic,
) -> None:
    ask = {"model": "tiny", "max_tokens": 2, "system": SYSTEM, "messages": USER}
    first = await claude.messages.create(**ask, extra_body=GREEDY)  # type: ignore[arg-type]
    again = await claude.messages.create(**ask, extra_body=GREEDY)  # type: ignore[arg-type]
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == total
    assert (again.usage.cache_read_input_tokens or 0) > 0
    assert again.content[0].text == first.content[0].text  # type: ignore[union-attr]


async def test_the_system_prompt_as_blocks_or_a_string_is_the_same_prompt(
    server: RunningServer, claude: anthropic.AsyncAnthropic
) -> None:
    blocks: Any = [{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}]
    as_blocks = await claude.messages.count_tokens(model="tiny", system=blocks, messages=USER)
    as_string = await claude.messages.count_tokens(
        model="tiny", system="You are\nterse.", messages=USER
    )
    without = await claude.messages.count_tokens(model="tiny", messages=USER)
    chat = [{"role": "system", "content": "You are\nterse."}, *USER]
    assert as_blocks.input_tokens == as_string.input_tokens
    assert as_string.input_tokens == len(engine_of(server).prepare_chat(chat).prompt_tokens)
    assert without.input_tokens == len(engine_of(server).prepare_chat(USER).prompt_tokens)
    assert without.input_tokens != as_string.input_tokens  # the template's default system prompt


async def test_a_stream_equals_its_final_message_and_the_unstreamed_answer(
    claude: anthropic.AsyncAnthropic,
) -> None:
    ask: Any = {"model": "tiny", "max_tokens": 10, "system": SYSTEM, "messages": USER}
    whole = await claude.messages.create(**ask, extra_body=GREEDY)
    async with claude.messages.stream(**ask, extra_body=GREEDY) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(pieces) > 1
    assert "".join(pieces) == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    total = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == total
    assert final.id.startswith("msg_") and final.model == "tiny"


async def test_the_stream_follows_anthropic_s_event_sequence(http: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "max_tokens": 6, "messages": USER, "stream": True, **GREEDY}
    response = await http.post("/v1/messages", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    texts = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" and d["text"] for d in texts)
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 6
    assert set(end["usage"]) == {
        "input_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    }


async def test_a_stop_sequence_ends_the_answer_and_is_named(
    claude: anthropic.AsyncAnthropic,
) -> None:
    ask: Any = {"model": "tiny", "max_tokens": 16, "messages": USER}
    free = (await claude.messages.create(**ask, extra_body=GREEDY)).content[0].text  # type: ignore[union-attr]
    words = free.split()
    assert len(words) > 3
    stop = words[2]  # a word the answer reaches after some text
    expected = free[: free.index(stop)]
    stopped = await claude.messages.create(**ask, stop_sequences=[stop], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == expected  # type: ignore[union-attr]
    async with claude.messages.stream(**ask, stop_sequences=[stop], extra_body=GREEDY) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == expected  # type: ignore[union-attr]


async def test_running_out_of_context_is_model_context_window_exceeded(
    server: RunningServer, claude: anthropic.AsyncAnthropic
) -> None:
    context = engine_of(server).context_length

    async def prompt_of(words: int) -> int:
        turns: Any = [{"role": "user", "content": "word " * words}]
        return (await claude.messages.count_tokens(model="tiny", messages=turns)).input_tokens

    low, high = await prompt_of(100), await prompt_of(200)
    words = 100 + (context - 8 - low) * 100 // (high - low)
    prompt = await prompt_of(words)
    assert context - 40 < prompt < context, "a prompt a few tokens short of the context"
    message = await claude.messages.create(
        model="tiny",
        max_tokens=100,
        messages=[{"role": "user", "content": "word " * words}],
        extra_body=GREEDY,
    )
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.output_tokens == context - prompt


async def test_a_last_assistant_turn_is_a_prefill_the_answer_continues(
    server: RunningServer, claude: anthropic.AsyncAnthropic
) -> None:
    turns: Any = [*USER, {"role": "assistant", "content": "My favourite colour is"}]
    continued = {"continue_final_message": True}
    engine = engine_of(server)
    direct = await engine.chat(turns, max_tokens=8, temperature=0, chat_template_kwargs=continued)
    prompt = engine.prepare_chat(turns, chat_template_kwargs=continued).prompt_tokens
    rendered = engine.tokenizer.decode(list(prompt))
    assert rendered.endswith("My favourite colour is")  # open: no end of turn after it
    count = await claude.messages.count_tokens(model="tiny", messages=turns)
    assert count.input_tokens == len(prompt)
    message = await claude.messages.create(
        model="tiny", max_tokens=8, messages=turns, extra_body=GREEDY
    )
    assert message.content[0].text == direct.text  # type: ignore[union-attr]
    plain = await claude.messages.create(
        model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY
    )
    assert message.content[0].text != plain.content[0].text  # type: ignore[union-attr]


async def test_consecutive_turns_of_one_role_are_one_turn(
    server: RunningServer, claude: anthropic.AsyncAnthropic
) -> None:
    split: Any = [{"role": "user", "content": "Name a"}, {"role": "user", "content": "colour."}]
    count = await claude.messages.count_tokens(model="tiny", messages=split)
    merged = [{"role": "user", "content": "Name a\ncolour."}]
    assert count.input_tokens == len(engine_of(server).prepare_chat(merged).prompt_tokens)


SCRIPT_TEXT = "<think>Paris is in France.</think>It is Paris."
PARIS = [{"role": "user", "content": "Capital of France?"}]


def thinking_loader(prompt_len: int, script: list[int]) -> Any:
    """The tiny model scripted to think, answer and end its turn (EOS), its tokenizer declaring
    `<think>` tags."""

    def loader(spec: str | Path | None) -> LoadedModel:
        loaded = load_model(spec)
        tokenizer = loaded.tokenizer
        tokenizer._think_start, tokenizer._think_end = "<think>", "</think>"
        tokenizer._think_start_tokens = tuple(tokenizer.encode("<think>", add_special_tokens=False))
        tokenizer._think_end_tokens = tuple(tokenizer.encode("</think>", add_special_tokens=False))
        return dataclasses.replace(loaded, model=ScriptedModel(loaded.model, prompt_len, script))

    return loader


async def test_reasoning_is_a_thinking_block_and_eos_is_end_turn(tiny_model_dir: Path) -> None:
    probe = load_model(tiny_model_dir).tokenizer
    eos = probe.eos_token_id
    script = [*probe.encode(SCRIPT_TEXT, add_special_tokens=False), eos]
    prompt = probe.apply_chat_template(PARIS, add_generation_prompt=True)
    if isinstance(prompt, dict):
        prompt = prompt["input_ids"]
    loader = thinking_loader(len(prompt), script)
    ask: Any = {"model": "tiny", "max_tokens": len(script) + 4, "messages": PARIS}
    async with (
        running_server(tiny_model_dir, loader=loader, served_model_names=("tiny",)) as server,
        claude_for(server) as claude,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        message = await claude.messages.create(**ask, extra_body=GREEDY)
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "Paris is in France."  # type: ignore[union-attr]
        assert message.content[1].text == "It is Paris."  # type: ignore[union-attr]
        assert message.stop_reason == "end_turn" and message.stop_sequence is None
        assert message.usage.output_tokens == len(script) - 1  # EOS is not counted
        async with claude.messages.stream(**ask, extra_body=GREEDY) as stream:
            final = await stream.get_final_message()
        assert final.model_dump()["content"] == message.model_dump()["content"]
        assert final.stop_reason == "end_turn"
        raw = await http.post("/v1/messages", json={**ask, "stream": True, **GREEDY})
        events = sse_events(raw.text)
        starts = [d for name, d in events if name == "content_block_start"]
        assert [(s["index"], s["content_block"]["type"]) for s in starts] == [
            (0, "thinking"),
            (1, "text"),
        ]
        stops = [d["index"] for name, d in events if name == "content_block_stop"]
        assert stops == [0, 1]
        kinds = {d["index"]: d["delta"]["type"] for n, d in events if n == "content_block_delta"}
        assert kinds == {0: "thinking_delta", 1: "text_delta"}


async def test_count_tokens_counts_the_rendered_prompt(
    server: RunningServer, claude: anthropic.AsyncAnthropic
) -> None:
    counted = await claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=USER)
    chat = [{"role": "system", "content": SYSTEM}, *USER]
    assert counted.input_tokens == len(engine_of(server).prepare_chat(chat).prompt_tokens)
    # A conversation longer than the context is counted too (nothing is generated).
    engine = engine_of(server)
    long: Any = [{"role": "user", "content": "word " * (engine.context_length + 10)}]
    assert (await claude.messages.count_tokens(model="tiny", messages=long)).input_tokens > (
        engine.context_length
    )


# ---- errors ------------------------------------------------------------------------------------


def kind(error: anthropic.APIStatusError) -> str:
    """The `error.type` of the body the client raised for (read from the body itself, which
    every version of the client keeps)."""
    body: Any = error.body
    return str(body["error"]["type"])


def said(error: anthropic.APIStatusError) -> str:
    body: Any = error.body
    return str(body["error"]["message"])


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The response is Anthropic's error shape with `status` and `kind`, naming its request as
    its `request-id` header does; returns the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    request_id = response.headers["request-id"]
    assert body == {
        "type": "error",
        "error": {"type": kind, "message": body["error"]["message"]},
        "request_id": request_id,
    }
    assert body["error"]["message"]
    return str(body["error"]["message"])


async def test_client_errors_raise_the_sdk_s_classes_with_anthropic_types(
    claude: anthropic.AsyncAnthropic,
) -> None:
    ok: Any = {"model": "tiny", "max_tokens": 4, "messages": USER}
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.messages.create(**{**ok, "model": "no-such-model"})
    assert missing.value.status_code == 404 and kind(missing.value) == "not_found_error"
    assert said(missing.value).startswith("model: ")
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.source.type: ",
        ),
        (  # a text-only model refuses an image, naming the block's source
            {"messages": [*USER, {"role": "user", "content": [PNG_BLOCK]}]},
            "messages.1.content.0.source: ",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use"}]}]},
            "messages.1.content.0.id: ",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t"}]}]},
            "messages.0.content.0.type: ",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages.0.content.0.source: ",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "search_result"}]}]},
            "messages.0.content.0.type: ",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type: "),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content."),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: "),
        ({"messages": []}, "messages: "),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema: "),
        ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema."),
        ({"tools": [{"name": "no spaces", "input_schema": {"type": "object"}}]}, "tools.0.name: "),
        ({"tool_choice": {"type": "any"}}, "tool_choice.type: "),
        ({"max_tokens": 0}, "max_tokens: "),
        ({"stop_sequences": [""]}, "stop_sequences.0: "),
        ({"extra_body": {"temperature": 1.5}}, "temperature: "),
        ({"extra_body": {"top_k": -1}}, "top_k: "),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens: "),
    ]
    for change, field in cases:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(**{**ok, **change})
        error = refused.value
        assert error.status_code == 400 and kind(error) == "invalid_request_error", change
        assert said(error).startswith(field), (change, said(error))
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.count_tokens(model="tiny", messages=[])
    assert kind(refused.value) == "invalid_request_error"


async def test_errors_before_any_route_take_anthropic_s_shape(http: httpx.AsyncClient) -> None:
    message = assert_anthropic_error(
        await http.post("/v1/messages", json={"model": "tiny", "messages": USER}),
        400,
        "invalid_request_error",
    )
    assert message == "max_tokens: Field required"
    bad_json = await http.post(
        "/v1/messages", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in assert_anthropic_error(bad_json, 400, "invalid_request_error")
    not_json = await http.post(
        "/v1/messages/count_tokens", content=b"hi", headers={"content-type": "text/plain"}
    )
    assert_anthropic_error(not_json, 415, "invalid_request_error")
    assert_anthropic_error(await http.post("/v1/messages/batches", json={}), 404, "not_found_error")
    wrong_method = await http.get("/v1/messages")
    assert_anthropic_error(wrong_method, 405, "invalid_request_error")
    assert "POST" in wrong_method.headers["allow"]
    # The OpenAI routes keep the OpenAI shape.
    openai_style = await http.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert (
        openai_style.status_code == 400 and openai_style.json()["error"]["code"] == "invalid_json"
    )


async def test_anthropic_headers_are_accepted(http: httpx.AsyncClient) -> None:
    headers = {
        "x-api-key": "sk-anything",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "some-feature-2025-01-01",
    }
    body = {"model": "tiny", "max_tokens": 2, "messages": USER, "metadata": {"user_id": "u1"}}
    response = await http.post("/v1/messages", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == 2


async def test_a_body_over_the_limit_is_413_in_anthropic_s_shape(tiny_model_dir: Path) -> None:
    async with (
        running_server(tiny_model_dir, max_body_bytes=2048) as server,
        claude_for(server) as claude,
    ):
        big: Any = [{"role": "user", "content": "x" * 4096}]
        with pytest.raises(anthropic.APIStatusError) as refused:
            await claude.messages.create(model="tiny-llama", max_tokens=2, messages=big)
        assert refused.value.status_code == 413 and kind(refused.value) == "request_too_large"
        small = await claude.messages.create(model="tiny-llama", max_tokens=2, messages=USER)
        assert small.usage.output_tokens == 2


async def test_a_busy_engine_is_529_overloaded_error_with_retry_after(
    tiny_model_dir: Path,
) -> None:
    # Anthropic answers a busy service with 529 `overloaded_error` (its 429 `rate_limit_error`
    # is an account over its limits); its clients retry both, after `retry-after`.
    loader, made = wrapping_loader(GatedModel)
    async with (
        running_server(
            tiny_model_dir, loader=loader, admission="fail-fast", max_num_seqs=1
        ) as server,
        claude_for(server) as claude,
        trio.open_nursery() as nursery,
    ):
        gate = made[0].gate
        gate.clear()  # the runner blocks in its next forward pass: the one slot stays held
        done = trio.Event()

        async def hold() -> None:
            await claude.messages.create(model="tiny-llama", max_tokens=3, messages=USER)
            done.set()

        nursery.start_soon(hold)
        engine = engine_of(server)
        await eventually(lambda: engine.get_stats()["running"] == 1)
        with pytest.raises(anthropic.InternalServerError) as busy:
            await claude.messages.create(model="tiny-llama", max_tokens=3, messages=USER)
        assert busy.value.status_code == 529 and kind(busy.value) == "overloaded_error"
        assert int(busy.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.InternalServerError) as busy:
            async with claude.messages.stream(
                model="tiny-llama", max_tokens=3, messages=USER
            ) as stream:
                await stream.get_final_message()
        assert busy.value.status_code == 529 and kind(busy.value) == "overloaded_error"
        # A client that retries (the SDK's default) waits `retry-after` and is served.
        refusals = engine.get_stats()["busy_rejections"]
        retried: list[anthropic.types.Message] = []

        async def retry() -> None:
            async with anthropic.AsyncAnthropic(
                base_url=server.url, api_key="unused", max_retries=1, timeout=30
            ) as patient:
                retried.append(
                    await patient.messages.create(model="tiny-llama", max_tokens=3, messages=USER)
                )

        nursery.start_soon(retry)
        await eventually(lambda: engine.get_stats()["busy_rejections"] > refusals)
        gate.set()
        with trio.fail_after(30):
            await done.wait()
        await eventually(lambda: bool(retried), limit=30)
        assert retried[0].usage.output_tokens == 3


async def test_a_failure_mid_stream_is_an_error_event(tiny_model_dir: Path) -> None:
    probe = load_model(tiny_model_dir).tokenizer
    prompt = probe.apply_chat_template(USER, add_generation_prompt=True)
    if isinstance(prompt, dict):
        prompt = prompt["input_ids"]
    fail_at = len(prompt) + 3  # the model fails on the fourth decode step
    loader, _ = wrapping_loader(lambda m: FaultyModel(m, poison=-1, fail_at_position=fail_at))
    body = {"model": "tiny-llama", "max_tokens": 50, "messages": USER, "stream": True, **GREEDY}
    async with (
        running_server(tiny_model_dir, loader=loader) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        claude_for(server) as claude,
    ):
        events = sse_events((await http.post("/v1/messages", json=body)).text)
        name, data = events[-1]
        assert name == "error" and data["type"] == "error"
        assert (
            data["error"]["type"] == "api_error" and "generation failed" in data["error"]["message"]
        )
        assert "message_stop" not in [n for n, _ in events]
        with pytest.raises(anthropic.APIStatusError) as failed:
            async with claude.messages.stream(
                model="tiny-llama", max_tokens=50, messages=USER, extra_body=GREEDY
            ) as stream:
                await stream.get_final_message()
        assert kind(failed.value) == "api_error"
        whole = await http.post("/v1/messages", json={**body, "stream": False})
        assert_anthropic_error(whole, 500, "api_error")


async def test_a_loading_model_is_503_overloaded_error(tiny_model_dir: Path) -> None:
    loaded = threading.Event()

    def slow_loader(spec: Any) -> Any:  # runs on the runner thread
        result = load_model(spec)
        loaded.wait(timeout=30)
        return result

    async with (
        running_server(tiny_model_dir, loader=slow_loader, wait_ready=False) as server,
        claude_for(server) as claude,
    ):
        for call in (
            claude.messages.create(model="tiny-llama", max_tokens=2, messages=USER),
            claude.messages.count_tokens(model="tiny-llama", messages=USER),
        ):
            with pytest.raises(anthropic.APIStatusError) as loading:
                await call
            assert loading.value.status_code == 503 and kind(loading.value) == "overloaded_error"
        loaded.set()
        with trio.fail_after(30):
            await server.state.ready.wait()
        ready = await claude.messages.create(model="tiny-llama", max_tokens=2, messages=USER)
        assert ready.usage.output_tokens == 2


class Verdict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # no other keys for the model to ramble

    colour: Literal["red", "green", "blue"]
    sure: bool


async def test_output_config_format_constrains_the_answer_to_its_schema(
    claude: anthropic.AsyncAnthropic, http: httpx.AsyncClient
) -> None:
    # Anthropic's structured outputs (`output_config.format`, what the SDK's messages.parse()
    # sends) were ignored: the tiny model answered gibberish and parse() raised.
    request: Any = {"model": "tiny", "max_tokens": 40, "messages": USER, "extra_body": GREEDY}
    parsed = await claude.messages.parse(output_format=Verdict, **request)
    assert parsed.stop_reason == "end_turn", parsed
    assert isinstance(parsed.parsed_output, Verdict)
    async with claude.messages.stream(output_format=Verdict, **request) as stream:
        final = await stream.get_final_message()
    assert final.parsed_output == parsed.parsed_output
    # The beta's top-level `output_format` is the same constraint.
    schema = Verdict.model_json_schema()
    beta = await http.post(
        "/v1/messages",
        json={
            "max_tokens": 40,
            "messages": USER,
            "temperature": 0,
            "output_format": {"type": "json_schema", "schema": schema},
        },
    )
    assert beta.status_code == 200, beta.text
    assert Verdict.model_validate_json(beta.json()["content"][0]["text"]) == parsed.parsed_output
    # A format the grammar cannot compile is a 400 naming it.
    with pytest.raises(anthropic.BadRequestError) as caught:
        await claude.messages.create(
            output_config={
                "format": {"type": "json_schema", "schema": {"type": "string", "pattern": "["}}
            },
            **request,
        )
    assert "output_config.format" in str(caught.value)
    # A prefill would be continued under the schema, the whole not JSON: refused.
    with pytest.raises(anthropic.BadRequestError) as caught:
        prefilled = [*USER, {"role": "assistant", "content": '{"colour": '}]
        await claude.messages.parse(output_format=Verdict, **{**request, "messages": prefilled})
    assert "output_config.format" in str(caught.value)
