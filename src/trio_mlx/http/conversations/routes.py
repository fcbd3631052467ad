"""The Conversations API's routes, as functions of the store returning OpenAI's objects:
`POST /v1/conversations` (create, with `items` and `metadata`), `GET`, `POST` (its `metadata`
replaced) and `DELETE /v1/conversations/{id}`; `POST` and `GET /v1/conversations/{id}/items`
(add up to 20 items; list them a page at a time: `limit`, `order`, `after`, as a response's
input items are listed), `GET` and `DELETE /v1/conversations/{id}/items/{item_id}` (deleting
an item returns the conversation, as OpenAI's does).

An unknown conversation or item is a 404 naming `conversation_id` or `item_id`; a refused body a
400 naming its field. `include` is accepted on the item routes and adds nothing: items are kept
whole.
"""

from __future__ import annotations

from typing import Any

from trio_mlx.http.conversations.requests import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
    checked_items,
)
from trio_mlx.http.conversations.store import Conversation, ConversationStore
from trio_mlx.http.objects import ConversationDeleted, ConversationObject, ResponseItemList
from trio_mlx.http.responses.items import items_page, read_items_query


def conversation_object(conversation: Conversation) -> dict[str, Any]:
    return ConversationObject.model_validate(conversation.object()).dump()


def create_conversation(
    store: ConversationStore, body: ConversationCreateRequest
) -> dict[str, Any]:
    items = checked_items(body.items)
    return conversation_object(store.create(body.metadata, items))


def retrieve_conversation(store: ConversationStore, conversation_id: str) -> dict[str, Any]:
    return conversation_object(store.get(conversation_id))


def update_conversation(
    store: ConversationStore, conversation_id: str, body: ConversationUpdateRequest
) -> dict[str, Any]:
    conversation = store.get(conversation_id)
    store.set_metadata(conversation, body.metadata or {})
    return conversation_object(conversation)


def delete_conversation(store: ConversationStore, conversation_id: str) -> dict[str, Any]:
    store.delete(conversation_id)
    return ConversationDeleted(id=conversation_id).dump()


def add_items(
    store: ConversationStore, conversation_id: str, body: ConversationItemsRequest
) -> dict[str, Any]:
    """The items as added (`ResponseItemList`, oldest first)."""
    conversation = store.get(conversation_id)
    added = store.add_items(conversation, checked_items(body.items))
    return ResponseItemList(
        data=added,
        first_id=added[0]["id"] if added else None,
        last_id=added[-1]["id"] if added else None,
        has_more=False,
    ).dump()


def list_items(
    store: ConversationStore, conversation_id: str, query: dict[str, str]
) -> dict[str, Any]:
    asked = read_items_query(query)
    conversation = store.get(conversation_id)
    unknown = f"no item {asked.after!r} in conversation {conversation_id!r}"
    return items_page(conversation.items, asked, unknown)


def retrieve_item(store: ConversationStore, conversation_id: str, item_id: str) -> dict[str, Any]:
    return store.get(conversation_id).item(item_id)


def delete_item(store: ConversationStore, conversation_id: str, item_id: str) -> dict[str, Any]:
    """The conversation, less the item."""
    conversation = store.get(conversation_id)
    store.delete_item(conversation, item_id)
    return conversation_object(conversation)
