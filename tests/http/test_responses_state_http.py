"""Stored responses: `store`, `previous_response_id` (HTTP and the WebSocket mode's connection
cache), `GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, the store's
bounds, `truncation: "auto"`, and a client that goes away, through the official openai client
(the raw routes where it cannot make the call) on the tiny random model with its real tokenizer.

The reference for a continued conversation is the same conversation sent whole in one request:
greedy, the two answer with the same text from a prompt of the same length.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from idle import wait_until_idle
from model_wrappers import FaultyModel, wrapping_loader
from servers import running_server
from trio_mlx.http.server import RunningServer

INSTRUCTIONS = "You are terse."
FIRST, SECOND, THIRD = "Name a colour.", "And another one?", "Which do you like best?"
GREEDY: dict[str, Any] = {"model": "tiny", "max_output_tokens": 6, "temperature": 0}
NOT_FOUND = "previous_response_not_found"


def said(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def items(response: Any) -> list[dict[str, Any]]:
    """A response's output items as a client sends them back as input."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def client_of(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30
    )


async def assert_not_found(client: openai.AsyncOpenAI, response_id: str) -> None:
    """The id is not stored: retrieval is a 404, continuing it OpenAI's 400."""
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.retrieve(response_id)
    error = missing.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["message"] == f"Response with id '{response_id}' not found."
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(**GREEDY, previous_response_id=response_id, input=SECOND)
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "message": f"Previous response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": NOT_FOUND,
    }


# ---- previous_response_id over HTTP --------------------------------------------------------------


async def test_a_continued_turn_answers_as_the_whole_conversation_sent_at_once(
    client: openai.AsyncOpenAI,
) -> None:
    first = await client.responses.create(**GREEDY, instructions=INSTRUCTIONS, input=FIRST)
    assert first.store is True and first.previous_response_id is None
    continued = await client.responses.create(
        **GREEDY, instructions=INSTRUCTIONS, previous_response_id=first.id, input=SECOND
    )
    whole = await client.responses.create(
        **GREEDY,
        instructions=INSTRUCTIONS,
        input=[said(FIRST), *items(first), said(SECOND)],  # type: ignore[list-item]
        store=False,
    )
    assert continued.previous_response_id == first.id
    assert continued.output_text == whole.output_text
    assert continued.usage is not None and whole.usage is not None and first.usage is not None
    assert continued.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    # `input_tokens.count` counts the same continued conversation.
    counted = await client.responses.input_tokens.count(
        model="tiny", instructions=INSTRUCTIONS, previous_response_id=first.id, input=SECOND
    )
    assert counted.input_tokens == continued.usage.input_tokens


async def test_instructions_do_not_carry_over_to_the_next_turn(
    client: openai.AsyncOpenAI,
) -> None:
    first = await client.responses.create(**GREEDY, instructions=INSTRUCTIONS, input=FIRST)
    continued = await client.responses.create(**GREEDY, previous_response_id=first.id, input=SECOND)
    whole = await client.responses.create(
        **GREEDY,
        input=[said(FIRST), *items(first), said(SECOND)],
        store=False,  # type: ignore[list-item]
    )
    assert continued.instructions is None
    assert continued.output_text == whole.output_text
    assert continued.usage is not None and whole.usage is not None
    assert continued.usage.input_tokens == whole.usage.input_tokens


async def test_a_chain_of_three_turns_streamed_and_whole(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(**GREEDY, instructions=INSTRUCTIONS, input=FIRST)
    stream = await client.responses.create(
        **GREEDY,
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[said(SECOND)],  # type: ignore[list-item]
        stream=True,
    )
    async with stream:
        async for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                second = event.response
    third = await client.responses.create(
        **GREEDY, instructions=INSTRUCTIONS, previous_response_id=second.id, input=THIRD
    )
    conversation = [said(FIRST), *items(first), said(SECOND), *items(second), said(THIRD)]
    whole = await client.responses.create(
        **GREEDY,
        instructions=INSTRUCTIONS,
        input=conversation,
        store=False,  # type: ignore[arg-type]
    )
    assert third.output_text == whole.output_text
    assert third.usage is not None and whole.usage is not None
    assert third.usage.input_tokens == whole.usage.input_tokens
    # Every turn is stored: the streamed one as its last event carried it.
    assert (await client.responses.retrieve(second.id)).model_dump() == second.model_dump()
    # The third's input items are the whole conversation before its answer, oldest first.
    listed = [item async for item in client.responses.input_items.list(third.id, order="asc")]
    assert [item.type for item in listed] == ["message"] * 5
    assert [item.role for item in listed] == ["user", "assistant", "user", "assistant", "user"]  # type: ignore[union-attr]
    assert [item.id for item in listed][1::2] == [first.output[0].id, second.output[0].id]
    texts = [item.content[0].text for item in listed]  # type: ignore[union-attr]
    assert texts == [FIRST, first.output_text, SECOND, second.output_text, THIRD]


async def test_store_false_keeps_nothing(client: openai.AsyncOpenAI) -> None:
    unstored = await client.responses.create(**GREEDY, input=FIRST, store=False)
    assert unstored.store is False
    await assert_not_found(client, unstored.id)
    await assert_not_found(client, "resp-never-made")


async def test_retrieve_then_delete_then_nothing(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    created = await client.responses.create(**GREEDY, instructions=INSTRUCTIONS, input=FIRST)
    retrieved = await client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    assert await client.responses.delete(created.id) is None
    await assert_not_found(client, created.id)
    again = await http.delete(f"/v1/responses/{created.id}")
    assert again.status_code == 404
    assert set(again.json()["error"]) == {"message", "type", "param", "code"}
    other = await client.responses.create(**GREEDY, input=FIRST)
    deleted = await http.delete(f"/v1/responses/{other.id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": other.id, "object": "response", "deleted": True}


async def test_input_items_come_a_page_at_a_time(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    first = await client.responses.create(**GREEDY, input=FIRST)
    conversation = [said(SECOND), said(THIRD), {"type": "message", "role": "user", "content": "?"}]
    last = await client.responses.create(
        **GREEDY,
        previous_response_id=first.id,
        input=conversation,  # type: ignore[arg-type]
    )
    page = await client.responses.input_items.list(last.id, limit=2)
    assert len(page.data) == 2 and page.has_more
    newest = [item.content[0].text for item in page.data]  # type: ignore[union-attr]
    assert newest == ["?", THIRD]  # desc: the newest first
    every = [item async for item in client.responses.input_items.list(last.id, limit=2)]
    assert [item.id for item in every][:2] == [item.id for item in page.data]
    assert len(every) == 5 and len({item.id for item in every}) == 5
    raw = (await http.get(f"/v1/responses/{last.id}/input_items?order=asc&limit=3")).json()
    assert raw["object"] == "list" and raw["has_more"] is True
    assert raw["first_id"] == raw["data"][0]["id"] and raw["last_id"] == raw["data"][-1]["id"]
    rest = (
        await http.get(f"/v1/responses/{last.id}/input_items?order=asc&after={raw['last_id']}")
    ).json()
    assert [item["id"] for item in raw["data"] + rest["data"]] == [item.id for item in every][::-1]
    assert rest["has_more"] is False
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order")):
        refused = await http.get(f"/v1/responses/{last.id}/input_items?{query}")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    unknown = await http.get(f"/v1/responses/{last.id}/input_items?after=msg-nope")
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "after"
    missing = await http.get("/v1/responses/resp-nope/input_items")
    assert missing.status_code == 404


async def test_a_continued_turn_reuses_the_first_turns_prefix_cache(
    client: openai.AsyncOpenAI,
) -> None:
    first = await client.responses.create(**GREEDY, instructions=INSTRUCTIONS, input=FIRST)
    continued = await client.responses.create(
        **GREEDY, instructions=INSTRUCTIONS, previous_response_id=first.id, input=SECOND
    )
    assert first.usage is not None and continued.usage is not None
    # The chat template renders the first turn's prompt again, unchanged, at the start of the
    # second's: its tokens come from the prefix cache, not from prefill.
    cached = continued.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens
    assert cached < continued.usage.input_tokens


# ---- the store's bounds ------------------------------------------------------------------------


async def test_the_oldest_responses_are_evicted_beyond_the_count(tiny_model_dir: Path) -> None:
    async with (
        running_server(tiny_model_dir, served_model_names=("tiny",), response_store_size=2) as srv,
        client_of(srv) as client,
    ):
        made = [await client.responses.create(**GREEDY, input=text) for text in (FIRST, SECOND)]
        newest = await client.responses.create(
            **GREEDY, previous_response_id=made[1].id, input=THIRD
        )
        await assert_not_found(client, made[0].id)
        for kept in (made[1], newest):
            assert (await client.responses.retrieve(kept.id)).id == kept.id
        stats = srv.state.responses.statistics()
        assert (stats.responses, stats.evicted, stats.max_responses) == (2, 1, 2)
        async with httpx.AsyncClient(base_url=srv.url) as http:
            status = (await http.get("/v1/status")).json()["server"]["response_store"]
        assert status["responses"] == 2 and status["bytes"] == stats.bytes > 0


async def test_the_oldest_responses_are_evicted_beyond_the_bytes(tiny_model_dir: Path) -> None:
    async with running_server(tiny_model_dir, served_model_names=("tiny",)) as probe:
        async with client_of(probe) as client:
            one = await client.responses.create(**GREEDY, input=FIRST)
        size = probe.state.responses.get(one.id).size  # type: ignore[union-attr]
    # Room for two such responses (their ids, texts and times differ by a few bytes), not three.
    bound = int(size * 2.5)
    async with (
        running_server(
            tiny_model_dir, served_model_names=("tiny",), response_store_bytes=bound
        ) as srv,
        client_of(srv) as client,
    ):
        made = [await client.responses.create(**GREEDY, input=FIRST) for _ in range(3)]
        await assert_not_found(client, made[0].id)
        assert [(await client.responses.retrieve(r.id)).id for r in made[1:]] == [
            r.id for r in made[1:]
        ]
        stats = srv.state.responses.statistics()
        assert stats.responses == 2 and stats.bytes <= bound
        # A response larger than the whole bound is not kept (nor does it evict the others).
        long = await client.responses.create(**GREEDY, input=FIRST * 200)
        await assert_not_found(client, long.id)
        assert srv.state.responses.statistics().responses == 2


async def test_a_store_of_size_0_keeps_nothing(tiny_model_dir: Path) -> None:
    async with (
        running_server(tiny_model_dir, served_model_names=("tiny",), response_store_size=0) as srv,
        client_of(srv) as client,
    ):
        created = await client.responses.create(**GREEDY, input=FIRST)
        await assert_not_found(client, created.id)


# ---- the WebSocket mode ------------------------------------------------------------------------

Turn = Callable[[list[dict[str, Any]]], dict[str, Any]]
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


def on_one_connection(server: RunningServer, *turns: Turn) -> list[dict[str, Any]]:
    """Send each turn's `response.create` on one connection through the openai client (a turn
    is built from the last events of the turns before it); each turn's last event."""
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    ends: list[dict[str, Any]] = []
    with sync.responses.connect() as connection:
        for turn in turns:
            connection.send({"type": "response.create", **turn(ends)})  # type: ignore[typeddict-item]
            for event in connection:
                if event.type in ENDS:
                    ends.append(event.to_dict())
                    break
    return ends


def fresh(**fields: Any) -> Turn:
    return lambda ends: {**GREEDY, **fields}


def continuing(turn: int, **fields: Any) -> Turn:
    """A turn continuing the response of turn number `turn` of the same session."""
    return lambda ends: {**GREEDY, "previous_response_id": ends[turn]["response"]["id"], **fields}


def assert_not_found_event(event: dict[str, Any]) -> None:
    assert event["type"] == "error" and event["status"] == 400
    assert event["error"]["code"] == NOT_FOUND
    assert event["error"]["param"] == "previous_response_id"
    assert event["error"]["type"] == "invalid_request_error"
    assert event["error"]["message"].startswith("Previous response with id ")


async def test_websocket_continues_its_latest_response_with_store_false(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    first, second, stale = await trio.to_thread.run_sync(
        lambda: on_one_connection(
            server,
            fresh(input=FIRST, store=False),
            continuing(0, input=SECOND, store=False),
            continuing(0, input=THIRD, store=False),  # no longer the connection's latest
        )
    )
    assert second["type"] == "response.incomplete", second
    assert second["response"]["previous_response_id"] == first["response"]["id"]
    whole = await client.responses.create(
        **GREEDY,
        input=[said(FIRST), *first["response"]["output"], said(SECOND)],
        store=False,
    )
    assert second["response"]["output_text"] == whole.output_text
    assert whole.usage is not None
    assert second["response"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert_not_found_event(stale)
    # Not stored: another connection, and HTTP, cannot continue it.
    (elsewhere,) = await trio.to_thread.run_sync(
        lambda: on_one_connection(
            server,
            lambda ends: {
                **GREEDY,
                "previous_response_id": second["response"]["id"],
                "input": THIRD,
            },
        )
    )
    assert_not_found_event(elsewhere)
    await assert_not_found(client, second["response"]["id"])


async def test_a_stored_websocket_response_continues_anywhere(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    (first,) = await trio.to_thread.run_sync(lambda: on_one_connection(server, fresh(input=FIRST)))
    response_id = first["response"]["id"]
    (other,) = await trio.to_thread.run_sync(
        lambda: on_one_connection(
            server, lambda ends: {**GREEDY, "previous_response_id": response_id, "input": SECOND}
        )
    )
    over_http = await client.responses.create(
        **GREEDY, previous_response_id=response_id, input=SECOND
    )
    assert other["type"] == "response.incomplete"
    assert other["response"]["output_text"] == over_http.output_text


async def test_a_failed_websocket_turn_drops_the_response_it_named(server: RunningServer) -> None:
    refused_tool = {"tools": [], "tool_choice": {"type": "function", "name": "nope"}}
    first, refused, retried = await trio.to_thread.run_sync(
        lambda: on_one_connection(
            server,
            fresh(input=FIRST, store=False),
            continuing(0, input=SECOND, store=False, **refused_tool),
            continuing(0, input=SECOND, store=False),
        )
    )
    assert first["type"] == "response.incomplete"
    assert refused["type"] == "error" and refused["error"]["param"] == "tool_choice"
    assert_not_found_event(retried)


# ---- a failed response ---------------------------------------------------------------------------


async def test_a_failed_response_is_not_kept_and_drops_what_it_continued(
    tiny_model_dir: Path,
) -> None:
    loader, made = wrapping_loader(lambda inner: FaultyModel(inner, poison=-1))
    async with (
        running_server(tiny_model_dir, loader=loader, served_model_names=("tiny",)) as srv,
        client_of(srv) as client,
    ):
        assert srv.state.engine is not None
        # The forward pass fails on the token of " apple": a generation error, not a refusal.
        (made[0].poison,) = srv.state.engine.tokenizer.encode(WORD, add_special_tokens=False)
        failed = await client.responses.create(**GREEDY, input=f"Name an{WORD}.")
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "generation_error"
        await assert_not_found(client, failed.id)
        first, broken, retried = await trio.to_thread.run_sync(
            lambda: on_one_connection(
                srv,
                fresh(input=FIRST, store=False),
                continuing(0, input=f"An{WORD}?", store=False),
                continuing(0, input=SECOND, store=False),
            )
        )
    assert first["type"] == "response.incomplete"
    assert broken["type"] == "response.failed"
    assert_not_found_event(retried)


# ---- truncation ---------------------------------------------------------------------------------

#: One token of the tiny model's tokenizer, every time; its context is 1024 tokens.
WORD = " apple"


async def test_truncation_auto_drops_the_oldest_items_of_a_chain(
    client: openai.AsyncOpenAI,
) -> None:
    first = await client.responses.create(**GREEDY, instructions=INSTRUCTIONS, input=WORD * 450)
    follow: dict[str, Any] = {
        **GREEDY,
        "instructions": INSTRUCTIONS,
        "previous_response_id": first.id,
        "input": WORD * 550,
    }
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(**follow)  # truncation "disabled", the default
    assert refused.value.code == "context_length_exceeded"
    truncated = await client.responses.create(**follow, truncation="auto")
    assert truncated.truncation == "auto" and truncated.status == "incomplete"
    # The first turn's question went; its answer and the instructions stayed.
    kept = [item async for item in client.responses.input_items.list(truncated.id, order="asc")]
    assert [item.role for item in kept] == ["assistant", "user"]  # type: ignore[union-attr]
    whole = await client.responses.create(
        **GREEDY,
        instructions=INSTRUCTIONS,
        input=[*items(first), said(WORD * 550)],  # type: ignore[list-item]
        store=False,
    )
    assert truncated.output_text == whole.output_text
    assert truncated.usage is not None and whole.usage is not None
    assert truncated.usage.input_tokens == whole.usage.input_tokens < 1024
    # The next turn continues the truncated conversation.
    after = await client.responses.create(
        **GREEDY, instructions=INSTRUCTIONS, previous_response_id=truncated.id, input=FIRST
    )
    assert after.usage is not None and after.status == "incomplete"
    listed = [item async for item in client.responses.input_items.list(after.id, order="asc")]
    assert [item.role for item in listed] == ["assistant", "user", "assistant", "user"]  # type: ignore[union-attr]


async def test_truncation_keeps_the_system_prompt_and_no_output_without_its_call(
    client: openai.AsyncOpenAI,
) -> None:
    system = {"role": "developer", "content": "Be brief."}
    call = {
        "type": "function_call",
        "call_id": "call-1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    result = {"type": "function_call_output", "call_id": "call-1", "output": WORD * 450}
    question = said(WORD * 600)
    truncated = await client.responses.create(
        **GREEDY,
        input=[system, said(FIRST), call, result, question],  # type: ignore[list-item]
        truncation="auto",
    )
    kept = [item async for item in client.responses.input_items.list(truncated.id, order="asc")]
    # Dropping the first question was not enough; the call went next, and its output with it.
    assert [(item.type, item.role) for item in kept] == [  # type: ignore[union-attr]
        ("message", "developer"),
        ("message", "user"),
    ]
    whole = await client.responses.create(
        **GREEDY,
        input=[system, question],
        store=False,  # type: ignore[list-item]
    )
    assert truncated.output_text == whole.output_text
    assert truncated.usage is not None and whole.usage is not None
    assert truncated.usage.input_tokens == whole.usage.input_tokens


async def test_truncation_cannot_cut_the_newest_item(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            **GREEDY,
            input=[said(FIRST), said(WORD * 1100)],
            truncation="auto",  # type: ignore[list-item]
        )
    assert refused.value.code == "context_length_exceeded"


# ---- a client that goes away -------------------------------------------------------------------

#: Without the tiny model's end-of-sequence token, a reply runs to its token limit.
NO_EOS = {"2": -100}


async def test_a_response_whose_client_went_away_is_not_kept(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    before = engine.get_stats()["runner"]
    stream = await client.responses.create(
        **{**GREEDY, "max_output_tokens": 900},
        input=FIRST,
        extra_body={"logit_bias": NO_EOS},
        stream=True,
    )
    async with stream:
        async for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break  # leaving the stream closes the connection mid-response
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before["aborted"] + 1
    await assert_not_found(client, response_id)


async def test_a_websocket_response_cut_short_by_its_client_is_not_kept(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    before = engine.get_stats()["runner"]

    def leave_mid_response() -> str:
        sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with sync.responses.connect() as connection:
            connection.send(
                {
                    "type": "response.create",
                    **GREEDY,
                    "max_output_tokens": 900,
                    "input": FIRST,
                    "logit_bias": NO_EOS,
                }  # type: ignore[typeddict-item]
            )
            for event in connection:
                if event.type == "response.created":
                    response_id = event.response.id
                if event.type == "response.output_text.delta":
                    return response_id  # leaving the block closes the socket
        raise AssertionError("the connection ended before the first delta")

    response_id = await trio.to_thread.run_sync(leave_mid_response)
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before["aborted"] + 1
    await assert_not_found(client, response_id)
