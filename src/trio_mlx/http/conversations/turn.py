"""A response in a conversation: `POST /v1/responses` (or a WebSocket `response.create`) with
`conversation` (its id, or `{"id": ...}`).

The conversation's items, as they stand when the request is admitted, come before the request's
`input` (`responses.prompt.ResponsePrompt`, as a previous response's would). When the response
ends `completed` or `incomplete` (whole, streamed, in the background; before its last event is
sent, so that a client that read it can go on at once), the request's input items, then its
output items, are appended to the conversation (`append`), whether or not the response itself
is stored (`store`). Nothing is appended for a response that failed, was cancelled, or whose
client went away before it ended (its generation was aborted): as at OpenAI, a conversation
gets the items of responses that ended. A conversation deleted or evicted meanwhile gets nothing.

`conversation` with `previous_response_id` is refused (400), as at OpenAI; an unknown
conversation is a 404 naming `conversation`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trio_mlx.http.conversations.store import ConversationStore

#: The statuses of a response whose items are appended to its conversation.
APPENDED = ("completed", "incomplete")


class ConversationTurn:
    """The conversation one request continues: its items when the request came, and where the
    response's items go when it ends."""

    def __init__(self, store: ConversationStore, conversation_id: str) -> None:
        conversation = store.get(conversation_id, param="conversation")
        self.id = conversation_id
        #: The conversation's items before this turn, oldest first.
        self.items: tuple[dict[str, Any], ...] = tuple(conversation.items)
        self._store = store

    def appender(
        self, request_items: Callable[[], list[dict[str, Any]]]
    ) -> Callable[[dict[str, Any]], None]:
        """What to do with the response once it ended (its object, dumped): append the
        request's input items (`request_items`, as kept) and its output items."""

        def append(response: dict[str, Any]) -> None:
            if response.get("status") in APPENDED:
                self._store.append(self.id, [*request_items(), *response["output"]])

        return append
