"""The Conversations API (`/v1/conversations`, its items) and the Responses `conversation`
parameter, through the official openai client on the tiny random model with its real tokenizer.

The reference for a turn through a conversation is the same turn through `previous_response_id`
and the whole conversation sent at once: greedy, the three answer with the same text from a
prompt of the same length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from idle import wait_until_idle
from servers import running_server
from trio_mlx.http.server import RunningServer

INSTRUCTIONS = "You are terse."
FIRST, SECOND, THIRD = "Name a colour.", "And another one?", "Which do you like best?"
GREEDY: dict[str, Any] = {"model": "tiny", "max_output_tokens": 6, "temperature": 0}
#: Without the tiny model's end-of-sequence token, a reply runs to its token limit.
NO_EOS = {"2": -100}


def said(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def items(response: Any) -> list[dict[str, Any]]:
    """A response's output items as a client sends them back as input."""
    return [item.model_dump(exclude_none=True) for item in response.output]


async def listed(client: openai.AsyncOpenAI, conversation_id: str) -> list[Any]:
    """Every item of the conversation, oldest first (the SDK following the pages)."""
    return [item async for item in client.conversations.items.list(conversation_id, order="asc")]


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict)
    return body


# ---- the conversation routes ---------------------------------------------------------------------


async def test_create_retrieve_update_delete(client: openai.AsyncOpenAI) -> None:
    created = await client.conversations.create(
        items=[
            said(FIRST),
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Blue."}],  # no annotations
            },
        ],
        metadata={"topic": "colours"},
    )
    assert created.object == "conversation" and created.id
    assert created.metadata == {"topic": "colours"} and created.created_at > 0
    retrieved = await client.conversations.retrieve(created.id)
    assert retrieved == created
    updated = await client.conversations.update(created.id, metadata={"topic": "shapes"})
    assert updated.metadata == {"topic": "shapes"} and updated.id == created.id
    assert (await client.conversations.retrieve(created.id)).metadata == {"topic": "shapes"}
    kept = await listed(client, created.id)
    assert [item.type for item in kept] == ["message", "message"]
    assert kept[0].role == "user" and kept[0].content[0].type == "input_text"
    assert kept[0].content[0].text == FIRST and kept[0].status == "completed"
    assert kept[1].role == "assistant" and kept[1].content[0].type == "output_text"
    assert kept[1].content[0].annotations == []

    deleted = await client.conversations.delete(created.id)
    assert deleted.model_dump() == {
        "id": created.id,
        "object": "conversation.deleted",
        "deleted": True,
    }
    for call in (
        client.conversations.retrieve(created.id),
        client.conversations.delete(created.id),
        client.conversations.items.list(created.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            await call
        assert error_of(missing.value) == {
            "message": f"Conversation with id '{created.id}' not found.",
            "type": "invalid_request_error",
            "param": "conversation_id",
            "code": "not_found",
        }


async def test_an_empty_conversation(client: openai.AsyncOpenAI) -> None:
    created = await client.conversations.create()
    assert created.metadata == {}
    page = await client.conversations.items.list(created.id)
    assert page.data == [] and page.has_more is False


async def test_items_are_listed_in_order_a_page_at_a_time(client: openai.AsyncOpenAI) -> None:
    texts = [f"message {i}" for i in range(7)]
    conversation = await client.conversations.create(items=[said(text) for text in texts[:3]])
    added = await client.conversations.items.create(
        conversation.id, items=[said(text) for text in texts[3:]]
    )
    assert [item.content[0].text for item in added.data] == texts[3:]  # type: ignore[union-attr]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    assert added.has_more is False

    oldest_first = await listed(client, conversation.id)
    assert [item.content[0].text for item in oldest_first] == texts
    ids = [item.id for item in oldest_first]
    assert len(set(ids)) == len(ids)
    # The default order is the newest first; pages follow `after`.
    first = await client.conversations.items.list(conversation.id, limit=3)
    assert [item.id for item in first.data] == ids[::-1][:3] and first.has_more is True
    assert first.last_id == ids[-3]
    second = await client.conversations.items.list(conversation.id, limit=3, after=first.last_id)
    assert [item.id for item in second.data] == ids[::-1][3:6]
    last = await client.conversations.items.list(conversation.id, limit=3, after=ids[1])
    assert [item.id for item in last.data] == [ids[0]] and last.has_more is False
    newest_first = [item.id async for item in client.conversations.items.list(conversation.id)]
    assert newest_first == ids[::-1]

    one = await client.conversations.items.retrieve(ids[2], conversation_id=conversation.id)
    assert one.id == ids[2] and one.content[0].text == texts[2]  # type: ignore[union-attr]
    after_delete = await client.conversations.items.delete(ids[2], conversation_id=conversation.id)
    assert after_delete.id == conversation.id and after_delete.object == "conversation"
    assert [item.id for item in await listed(client, conversation.id)] == ids[:2] + ids[3:]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.conversations.items.retrieve(ids[2], conversation_id=conversation.id)
    assert error_of(missing.value)["param"] == "item_id"
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.delete(ids[2], conversation_id=conversation.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.conversations.items.list(conversation.id, after=ids[2])
    assert error_of(refused.value)["param"] == "after"


async def test_refused_bodies_name_their_field(client: openai.AsyncOpenAI) -> None:
    conversation = await client.conversations.create()
    cases: list[tuple[Any, str]] = [
        (client.conversations.create(items=[said(str(i)) for i in range(21)]), "items"),
        (client.conversations.items.create(conversation.id, items=[]), "items"),
        (
            client.conversations.items.create(
                conversation.id, items=[said("x") for _ in range(21)]
            ),
            "items",
        ),
        (
            client.conversations.items.create(
                conversation.id,
                items=[said("fine"), {"type": "message", "role": "user"}],  # type: ignore[list-item]
            ),
            "items[1].content",
        ),
        (
            client.conversations.create(
                items=[{"type": "function_call", "name": "f", "arguments": "{}"}]  # type: ignore[list-item]
            ),
            "items[0].call_id",
        ),
        (client.conversations.create(metadata={str(i): "v" for i in range(17)}), "metadata"),
        (client.conversations.update(conversation.id, metadata={"k" * 65: "v"}), "metadata"),
        (client.conversations.items.list(conversation.id, limit=101), "limit"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            await call
        error = error_of(refused.value)
        assert error["type"] == "invalid_request_error"
        assert error["param"] is not None and error["param"].startswith(param), (param, error)
    assert await listed(client, conversation.id) == []  # nothing of a refused request was added
    with pytest.raises(openai.NotFoundError) as missing:
        await client.conversations.items.create("conv-nope", items=[said("x")])
    assert error_of(missing.value)["param"] == "conversation_id"


# ---- responses in a conversation -----------------------------------------------------------------


async def test_a_turn_through_a_conversation_answers_as_previous_response_id_does(
    client: openai.AsyncOpenAI,
) -> None:
    conversation = await client.conversations.create()
    first = await client.responses.create(
        **GREEDY, instructions=INSTRUCTIONS, conversation=conversation.id, input=FIRST
    )
    assert first.conversation is not None and first.conversation.id == conversation.id
    second = await client.responses.create(
        **GREEDY,
        instructions=INSTRUCTIONS,
        conversation={"id": conversation.id},
        input=[said(SECOND)],  # type: ignore[list-item]
    )
    # The same turns through previous_response_id, and the whole conversation at once.
    chained_first = await client.responses.create(**GREEDY, instructions=INSTRUCTIONS, input=FIRST)
    chained = await client.responses.create(
        **GREEDY, instructions=INSTRUCTIONS, previous_response_id=chained_first.id, input=SECOND
    )
    whole = await client.responses.create(
        **GREEDY,
        instructions=INSTRUCTIONS,
        input=[said(FIRST), *items(first), said(SECOND)],  # type: ignore[list-item]
        store=False,
    )
    assert first.output_text == chained_first.output_text
    assert second.output_text == chained.output_text == whole.output_text
    assert second.usage is not None and chained.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == chained.usage.input_tokens == whole.usage.input_tokens
    counted = await client.responses.input_tokens.count(
        model="tiny", instructions=INSTRUCTIONS, conversation=conversation.id, input=THIRD
    )
    assert counted.input_tokens > second.usage.input_tokens

    # The conversation holds each turn's input then its output, in order.
    kept = await listed(client, conversation.id)
    assert [(item.type, getattr(item, "role", None)) for item in kept] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert kept[0].content[0].text == FIRST and kept[2].content[0].text == SECOND
    assert kept[1].id == first.output[0].id and kept[3].id == second.output[0].id
    assert kept[3].content[0].text == second.output_text
    # The response's own input items are the conversation's before it, then its input.
    input_items = [item.id async for item in client.responses.input_items.list(second.id)]
    assert input_items == [item.id for item in kept[:3]][::-1]


async def test_streamed_and_background_turns_are_appended_once_ended(
    client: openai.AsyncOpenAI,
) -> None:
    conversation = await client.conversations.create(items=[said(FIRST)])
    stream = await client.responses.create(
        **GREEDY, conversation=conversation.id, input=SECOND, stream=True
    )
    async with stream:
        async for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                streamed = event.response
    assert streamed.conversation is not None and streamed.conversation.id == conversation.id
    kept = await listed(client, conversation.id)  # appended before the last event was sent
    assert len(kept) == 3 and kept[2].id == streamed.output[0].id

    job = await client.responses.create(
        **GREEDY, conversation=conversation.id, input=THIRD, background=True
    )
    with trio.fail_after(30):
        while job.status in ("queued", "in_progress"):
            await trio.sleep(0.05)
            job = await client.responses.retrieve(job.id)
    assert job.status in ("completed", "incomplete")
    kept = await listed(client, conversation.id)
    assert [item.id for item in kept[3:]] == [kept[3].id, job.output[0].id]
    assert kept[3].content[0].text == THIRD


async def test_store_false_still_appends_to_the_conversation(client: openai.AsyncOpenAI) -> None:
    conversation = await client.conversations.create()
    response = await client.responses.create(
        **GREEDY, conversation=conversation.id, input=FIRST, store=False
    )
    assert [item.id for item in await listed(client, conversation.id)][1] == response.output[0].id
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)


async def test_a_turn_whose_client_went_away_is_not_appended(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    conversation = await client.conversations.create(items=[said(FIRST)])
    before = engine.get_stats()["runner"]
    stream = await client.responses.create(
        **{**GREEDY, "max_output_tokens": 900},
        conversation=conversation.id,
        input=SECOND,
        extra_body={"logit_bias": NO_EOS},
        stream=True,
    )
    async with stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                break  # leaving the stream closes the connection mid-response
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before["aborted"] + 1
    kept = await listed(client, conversation.id)
    assert [item.content[0].text for item in kept] == [FIRST]  # the turn left nothing


async def test_a_cancelled_background_turn_is_not_appended(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    conversation = await client.conversations.create(items=[said(FIRST)])
    job = await client.responses.create(
        **{**GREEDY, "max_output_tokens": 900},
        conversation=conversation.id,
        input=SECOND,
        extra_body={"logit_bias": NO_EOS},
        background=True,
    )
    cancelled = await client.responses.cancel(job.id)
    assert cancelled.status == "cancelled"
    assert len(await listed(client, conversation.id)) == 1


async def test_conversation_errors_on_responses(client: openai.AsyncOpenAI) -> None:
    conversation = await client.conversations.create()
    first = await client.responses.create(**GREEDY, input=FIRST)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            **GREEDY, conversation=conversation.id, previous_response_id=first.id, input=SECOND
        )
    assert error_of(refused.value) == {
        "message": "Mutually exclusive parameters: Ensure you are only providing one of: "
        "'previous_response_id' or 'conversation'.",
        "type": "invalid_request_error",
        "param": "conversation",
        "code": "mutually_exclusive_parameters",
    }
    with pytest.raises(openai.BadRequestError):
        await client.responses.input_tokens.count(
            model="tiny", conversation=conversation.id, previous_response_id=first.id
        )
    for call in (
        client.responses.create(**GREEDY, conversation="conv-unknown", input=FIRST),
        client.responses.create(**GREEDY, conversation={"id": "conv-unknown"}, input=FIRST),
        client.responses.input_tokens.count(model="tiny", conversation="conv-unknown"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            await call
        assert error_of(missing.value) == {
            "message": "Conversation with id 'conv-unknown' not found.",
            "type": "invalid_request_error",
            "param": "conversation",
            "code": "not_found",
        }
    assert await listed(client, conversation.id) == []


async def test_a_conversation_deleted_while_its_turn_runs_gets_nothing(
    client: openai.AsyncOpenAI,
) -> None:
    conversation = await client.conversations.create(items=[said(FIRST)])
    stream = await client.responses.create(
        **GREEDY, conversation=conversation.id, input=SECOND, stream=True
    )
    async with stream:
        async for event in stream:
            if event.type == "response.created":
                await client.conversations.delete(conversation.id)
            if event.type in ("response.completed", "response.incomplete"):
                ended = event.response
    assert ended.output_text
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conversation.id)


async def test_the_websocket_mode_takes_a_conversation(server: RunningServer) -> None:
    def two_turns() -> tuple[str, list[dict[str, Any]]]:
        sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        conversation = sync.conversations.create()
        ended = []
        with sync.responses.connect() as connection:
            for text in (FIRST, SECOND):
                connection.send(
                    {
                        "type": "response.create",
                        **GREEDY,
                        "conversation": conversation.id,
                        "input": text,
                    }  # type: ignore[typeddict-item]
                )
                for event in connection:
                    if event.type in ("response.completed", "response.incomplete"):
                        ended.append(event.response.model_dump())
                        break
        kept = [item.model_dump() for item in sync.conversations.items.list(conversation.id)]
        return conversation.id, [*ended, *kept]

    conversation_id, (first, second, *kept) = await trio.to_thread.run_sync(two_turns)
    assert first["conversation"] == {"id": conversation_id}
    assert [item["id"] for item in kept][::-1][1] == first["output"][0]["id"]
    assert kept[0]["id"] == second["output"][0]["id"] and len(kept) == 4


# ---- bounds --------------------------------------------------------------------------------------


async def test_the_least_recently_used_conversation_is_evicted(tiny_model_dir: Path) -> None:
    async with (
        running_server(tiny_model_dir, served_model_names=("tiny",), response_store_size=2) as srv,
        openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        a = await client.conversations.create()
        b = await client.conversations.create()
        await client.conversations.retrieve(a.id)  # a is used: b is now the oldest
        c = await client.conversations.create()
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(b.id)
        assert (await client.conversations.retrieve(a.id)).id == a.id
        assert (await client.conversations.retrieve(c.id)).id == c.id
        async with httpx.AsyncClient(base_url=srv.url) as http:
            status = (await http.get("/v1/status")).json()["server"]["conversations"]
        assert status["conversations"] == 2 and status["evicted"] == 1
        assert status["max_conversations"] == 2


async def test_a_conversation_larger_than_the_store_is_refused(tiny_model_dir: Path) -> None:
    async with (
        running_server(
            tiny_model_dir, served_model_names=("tiny",), response_store_bytes=2000
        ) as srv,
        openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        conversation = await client.conversations.create(items=[said("short")])
        with pytest.raises(openai.BadRequestError) as refused:
            await client.conversations.items.create(conversation.id, items=[said("x" * 3000)])
        assert error_of(refused.value)["param"] == "items"
        assert len(await listed(client, conversation.id)) == 1


async def test_a_server_that_keeps_nothing_refuses_conversations(tiny_model_dir: Path) -> None:
    async with (
        running_server(tiny_model_dir, served_model_names=("tiny",), response_store_size=0) as srv,
        openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.conversations.create()
        assert "keeps no conversations" in error_of(refused.value)["message"]
