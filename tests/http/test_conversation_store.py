"""The conversation store's bounds and bookkeeping (`http/conversations/store.py`), without a
server: bytes counted as items come and go, the least recently used evicted first, a response's
items that would outgrow the whole budget drop their conversation, ids kept unique."""

from __future__ import annotations

from typing import Any

import pytest

from trio_mlx.http.conversations.store import ConversationStore
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import json_text


def message(item_id: str, text: str = "hello") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
        "status": "completed",
    }


def size(*items: dict[str, Any], metadata: dict[str, str] | None = None) -> int:
    return len(json_text(metadata or {})) + sum(len(json_text(item)) for item in items)


def test_bytes_follow_items_and_metadata() -> None:
    store = ConversationStore(10, 10_000)
    conversation = store.create({"a": "b"}, [message("m1")])
    assert store.statistics().bytes == size(message("m1"), metadata={"a": "b"})
    store.add_items(conversation, [message("m2", "more")])
    store.set_metadata(conversation, {})
    assert store.statistics().bytes == size(message("m1"), message("m2", "more"))
    store.delete_item(conversation, "m1")
    assert store.statistics().bytes == size(message("m2", "more")) == conversation.size
    store.delete(conversation.id)
    assert store.statistics().bytes == 0 and store.statistics().conversations == 0


def test_the_least_recently_used_goes_first_when_bytes_run_out() -> None:
    one = size(message("x" * 8, "y" * 100))
    store = ConversationStore(10, 3 * one)
    a, b, c = (store.create(None, [message(f"{n}" * 8, "y" * 100)]) for n in "abc")
    store.get(a.id)  # a is used: b is the least recently used
    store.append(c.id, [message("d" * 8, "y" * 100)])
    assert store.find(b.id) is None and store.find(a.id) is a and store.find(c.id) is c
    assert store.statistics().evicted == 1 and store.statistics().bytes <= 3 * one


def test_items_larger_than_the_budget() -> None:
    store = ConversationStore(10, 1000)
    conversation = store.create(None, [message("m1")])
    with pytest.raises(APIError) as refused:
        store.add_items(conversation, [message("m2", "x" * 2000)])
    assert refused.value.status == 400 and refused.value.param == "items"
    assert [item["id"] for item in conversation.items] == ["m1"]
    # A response's items are not refused: the conversation that cannot hold them goes.
    store.append(conversation.id, [message("m3", "x" * 2000)])
    assert store.find(conversation.id) is None and store.statistics().bytes == 0


def test_ids_stay_unique_in_a_conversation() -> None:
    store = ConversationStore()
    conversation = store.create(None, [message("msg_1"), message("msg_1")])
    store.append(conversation.id, [message("msg_1")])
    ids = [item["id"] for item in conversation.items]
    assert ids[0] == "msg_1" and len(set(ids)) == 3
    assert all(item_id.startswith("msg_") for item_id in ids)
    assert conversation.item(ids[2])["content"][0]["text"] == "hello"


def test_a_store_of_size_0_makes_none() -> None:
    with pytest.raises(APIError) as refused:
        ConversationStore(0).create(None)
    assert refused.value.status == 400


def test_metadata_that_would_outgrow_the_budget_is_refused() -> None:
    """`POST /v1/conversations/{id}` replaces the metadata: metadata that would make the
    conversation larger than the whole budget is refused (400), as items are; the store never
    holds more than its bound."""
    store = ConversationStore(10, 300)
    conversation = store.create({"a": "b"}, [message("m1")])
    large = {f"key{n}": "v" * 100 for n in range(16)}  # within OpenAI's 16 keys of 512 chars
    with pytest.raises(APIError) as refused:
        store.set_metadata(conversation, large)
    assert refused.value.status == 400 and refused.value.param == "metadata"
    assert conversation.metadata == {"a": "b"}  # unchanged
    assert store.statistics().bytes == conversation.size <= 300
    with pytest.raises(APIError) as refused:
        store.create(large)
    assert refused.value.status == 400 and refused.value.param == "metadata"
    assert store.statistics().conversations == 1
