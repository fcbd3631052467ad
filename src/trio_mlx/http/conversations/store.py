"""The server's conversations (`/v1/conversations`), kept in memory.

A conversation is its id, its creation time, its `metadata` and its items, oldest first, each
in the shape a stored response keeps its input items (`responses.items.kept_item`: an `id`, a
`status`, a message's text as content parts), output items as the response wrote them. Items
come from `POST /v1/conversations` and `.../items` (at most 20 a request), and from each
response created with `conversation` once it has ended (`turn`). Item dicts are shared with the
stored responses that hold them too, and are never changed.

Bounded as the response store is (`responses.store.ResponseStore`), by the same settings but a
budget of their own: at most `--response-store-size` conversations and `--response-store-mb`
MiB of them (the JSON length of their items and metadata). The least recently used (created,
read, written to, used by a response) is evicted first; a bound of 0 keeps none, and the
conversation routes then refuse to create one (400). Items or metadata that would make one
conversation alone larger than the whole budget are refused (400) when a client adds them; when
a response's items would, the conversation is dropped (logged): the store never holds more than
its bound.

Everything runs on the Trio thread: no locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trio_mlx.bounded_map import BoundedMap
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import json_text, new_id
from trio_mlx.http.responses.store import DEFAULT_MEGABYTES, DEFAULT_RESPONSES

log = logging.getLogger("trio_mlx.http")


@dataclass
class Conversation:
    """One conversation: its object's fields and its items, oldest first."""

    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)
    #: The ids of `items`.
    item_ids: set[str] = field(default_factory=set)
    #: What the store counts for it: the JSON length of its items and metadata.
    size: int = 0

    def object(self) -> dict[str, Any]:
        """OpenAI's conversation object."""
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def item(self, item_id: str) -> dict[str, Any]:
        """One item, or the 404 of an id it does not hold."""
        if item_id in self.item_ids:
            for item in self.items:
                if item["id"] == item_id:
                    return item
        raise item_not_found(self.id, item_id)

    def _size(self) -> int:
        return len(json_text(self.metadata)) + sum(len(json_text(item)) for item in self.items)


@dataclass(frozen=True)
class ConversationStatistics:
    """A snapshot of the store (`/v1/status`'s `conversations`)."""

    conversations: int
    bytes: int
    evicted: int
    max_conversations: int
    max_bytes: int


class ConversationStore:
    """At most `max_conversations` conversations and `max_bytes` in all, the least recently
    used evicted first (see the module docstring)."""

    def __init__(
        self,
        max_conversations: int = DEFAULT_RESPONSES,
        max_bytes: int = int(DEFAULT_MEGABYTES * 1024 * 1024),
    ) -> None:
        self.max_conversations = max(0, max_conversations)
        self.max_bytes = max(0, max_bytes)
        #: Each counted at its `size`, kept in sync with it (`_resized`).
        self._conversations: BoundedMap[str, Conversation] = BoundedMap(
            self.max_conversations, self.max_bytes
        )
        #: Conversations dropped by `append`: counted as evicted.
        self._dropped = 0

    @property
    def enabled(self) -> bool:
        return self.max_conversations > 0 and self.max_bytes > 0

    def create(
        self, metadata: dict[str, str] | None, items: Iterable[dict[str, Any]] = ()
    ) -> Conversation:
        """A new conversation holding `items` (kept items, each with an `id`)."""
        if not self.enabled:
            raise APIError(
                400,
                "this server keeps no conversations "
                "(--response-store-size or --response-store-mb is 0)",
                param=None,
                code="conversations_disabled",
            )
        conversation = Conversation(new_id("conv"), int(time.time()), dict(metadata or {}))
        conversation.size = conversation._size()
        self._fit(conversation, [], param="metadata")
        self._fit(conversation, list(items), param="items")
        self._conversations.put(conversation.id, conversation, conversation.size)
        self._add(conversation, list(items))
        return conversation

    def get(self, conversation_id: str, param: str = "conversation_id") -> Conversation:
        """A conversation (now the most recently used), or the 404 of an unknown id naming
        `param`."""
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            raise conversation_not_found(conversation_id, param)
        self._conversations.touch(conversation_id)
        return conversation

    def find(self, conversation_id: str) -> Conversation | None:
        """A conversation if it is still kept (not evicted, not deleted), leaving its place."""
        return self._conversations.get(conversation_id)

    def delete(self, conversation_id: str) -> None:
        """Forget a conversation; the 404 of an unknown id."""
        if self._conversations.pop(conversation_id) is None:
            raise conversation_not_found(conversation_id)

    def add_items(
        self, conversation: Conversation, items: list[dict[str, Any]], param: str = "items"
    ) -> list[dict[str, Any]]:
        """Append a client's `items` (kept items) to a kept conversation; the items as added (an
        id the conversation already holds is given a new one). A 400 naming `param` when they
        would make the conversation larger than the store's whole budget."""
        self._fit(conversation, items, param)
        return self._add(conversation, items)

    def append(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Append a response's items to a conversation, if it is still kept; one that would
        outgrow the whole budget is dropped (see the module docstring)."""
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            return
        added = sum(len(json_text(item)) for item in items)
        if conversation.size + added > self.max_bytes:
            log.warning(
                "conversation %s dropped: with its latest response's items it would take "
                "more than --response-store-mb",
                conversation_id,
            )
            self.delete(conversation_id)
            self._dropped += 1
            return
        self._conversations.touch(conversation_id)
        self._add(conversation, items)

    def delete_item(self, conversation: Conversation, item_id: str) -> None:
        """Remove one item; the 404 of an id the conversation does not hold."""
        item = conversation.item(item_id)
        conversation.items.remove(item)
        conversation.item_ids.discard(item_id)
        conversation.size -= len(json_text(item))
        self._resized(conversation)

    def set_metadata(self, conversation: Conversation, metadata: dict[str, str]) -> None:
        """Replace a kept conversation's metadata; a 400 when it would make the conversation
        larger than the store's whole budget."""
        change = len(json_text(metadata)) - len(json_text(conversation.metadata))
        if conversation.size + change > self.max_bytes:
            raise APIError(
                400,
                f"the conversation would take {conversation.size + change} bytes, more than "
                f"this server keeps in all ({self.max_bytes}, --response-store-mb)",
                param="metadata",
            )
        conversation.metadata = dict(metadata)
        conversation.size += change
        self._resized(conversation)

    def statistics(self) -> ConversationStatistics:
        return ConversationStatistics(
            conversations=len(self._conversations),
            bytes=self._conversations.bytes,
            evicted=self._conversations.evicted + self._dropped,
            max_conversations=self.max_conversations,
            max_bytes=self.max_bytes,
        )

    def _fit(self, conversation: Conversation, items: list[dict[str, Any]], param: str) -> None:
        added = sum(len(json_text(item)) for item in items)
        if conversation.size + added > self.max_bytes:
            raise APIError(
                400,
                f"the conversation would take {conversation.size + added} bytes, more than "
                f"this server keeps in all ({self.max_bytes}, --response-store-mb)",
                param=param,
            )

    def _add(self, conversation: Conversation, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        added = []
        for item in items:
            if item["id"] in conversation.item_ids:  # ids are unique in a conversation
                prefix = str(item["id"]).split("-")[0].split("_")[0] or "item"
                item = {**item, "id": new_id(prefix)}
            conversation.items.append(item)
            conversation.item_ids.add(item["id"])
            added.append(item)
        conversation.size += sum(len(json_text(item)) for item in added)
        self._resized(conversation)
        return added

    def _resized(self, conversation: Conversation) -> None:
        """Count a kept conversation at its new `size`, evicting the least recently used others
        until both bounds hold (its callers checked that it fits)."""
        self._conversations.resize(conversation.id, conversation.size)


def conversation_not_found(conversation_id: str, param: str = "conversation_id") -> APIError:
    """The 404 of a conversation that is not kept (never made, deleted, evicted)."""
    return APIError(
        404,
        f"Conversation with id '{conversation_id}' not found.",
        param=param,
        code="not_found",
    )


def item_not_found(conversation_id: str, item_id: str) -> APIError:
    return APIError(
        404,
        f"Item with id '{item_id}' not found in conversation '{conversation_id}'.",
        param="item_id",
        code="not_found",
    )
