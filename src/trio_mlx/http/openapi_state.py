"""The OpenAPI paths of what the server holds between requests: stored and background
responses (`/v1/responses/{response_id}`), and the Conversations API (`/v1/conversations`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from trio_mlx.http.conversations.requests import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
)
from trio_mlx.http.objects import (
    ConversationDeleted,
    ConversationObject,
    ResponseDeleted,
    ResponseItemList,
    ResponseObject,
    ResponseStreamEvent,
)
from trio_mlx.http.openapi_parts import error_responses, json_operation, named_event_stream, ref

#: The path parameter of the stored-response routes.
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


#: The query of the item lists (a stored response's input items, a conversation's).
ITEMS_QUERY = [
    {
        "name": "after",
        "in": "query",
        "required": False,
        "description": "List the items after the item with this id (the next page).",
        "schema": {"type": "string"},
    },
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
    },
    {
        "name": "order",
        "in": "query",
        "required": False,
        "schema": {"enum": ["asc", "desc"], "default": "desc"},
    },
]


def stored_response_paths() -> dict[str, Any]:
    """`GET` and `DELETE /v1/responses/{response_id}`, `GET .../input_items`."""
    query = ITEMS_QUERY
    resume = [
        {
            "name": "stream",
            "in": "query",
            "required": False,
            "description": "`true`: the events of a response created with `background` and "
            "`stream`, as it runs or after it has ended",
            "schema": {"enum": ["true", "false"]},
        },
        {
            "name": "starting_after",
            "in": "query",
            "required": False,
            "description": "With `stream`: the events after the one of this `sequence_number`",
            "schema": {"type": "integer"},
        },
    ]
    retrieved = json_operation(
        "A stored response (`store`), or a background one as it stands (`queued`, "
        "`in_progress` with its output so far, then as it ended)",
        ref(ResponseObject),
        "400",
        "404-response",
    )
    retrieved["responses"]["200"]["content"]["text/event-stream"] = named_event_stream(
        ResponseStreamEvent
    )
    return {
        "/v1/responses/{response_id}": {
            "parameters": [RESPONSE_ID],
            "get": retrieved | {"parameters": resume},
            "delete": json_operation(
                "Delete a stored response (a background one that runs is cancelled)",
                ref(ResponseDeleted),
                "404-response",
            ),
        },
        "/v1/responses/{response_id}/cancel": {
            "parameters": [RESPONSE_ID],
            "post": json_operation(
                "Cancel a background response: it ends `cancelled` with the output written so "
                "far; one that has ended is returned as it ended; 400 for a response not "
                "created with `background`",
                ref(ResponseObject),
                "400",
                "404-response",
            ),
        },
        "/v1/responses/{response_id}/input_items": {
            "parameters": [RESPONSE_ID],
            "get": json_operation(
                "A stored response's input items, a page at a time: the conversation before "
                "its output (the earlier turns' items included)",
                ref(ResponseItemList),
                "400",
                "404-response",
            )
            | {"parameters": query},
        },
    }


#: The path parameters of the conversation routes.
CONVERSATION_ID = {
    "name": "conversation_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
}
ITEM_ID = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}


def with_body(operation: dict[str, Any], body: type[BaseModel], *errors: str) -> dict[str, Any]:
    """`operation` (`_get`'s) taking a JSON `body`, with the errors of reading one."""
    operation["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": ref(body)}},
    }
    operation["responses"] |= error_responses("400", "413", "415", *errors)
    return operation


def conversation_paths() -> dict[str, Any]:
    """The Conversations API: `/v1/conversations` and its items."""
    item = {"type": "object", "required": ["id", "type"]}
    return {
        "/v1/conversations": {
            "post": with_body(
                json_operation(
                    "Create a conversation, with its first `items` (at most 20) and `metadata`",
                    ref(ConversationObject),
                ),
                ConversationCreateRequest,
            )
        },
        "/v1/conversations/{conversation_id}": {
            "parameters": [CONVERSATION_ID],
            "get": json_operation("A conversation", ref(ConversationObject), "404-conversation"),
            "post": with_body(
                json_operation(
                    "Replace a conversation's `metadata`",
                    ref(ConversationObject),
                    "404-conversation",
                ),
                ConversationUpdateRequest,
            ),
            "delete": json_operation(
                "Delete a conversation and its items",
                ref(ConversationDeleted),
                "404-conversation",
            ),
        },
        "/v1/conversations/{conversation_id}/items": {
            "parameters": [CONVERSATION_ID],
            "post": with_body(
                json_operation(
                    "Append items (at most 20) to a conversation; the items as added, each "
                    "with its `id`",
                    ref(ResponseItemList),
                    "404-conversation",
                ),
                ConversationItemsRequest,
            ),
            "get": json_operation(
                "A conversation's items, a page at a time (`desc`, the newest first, by default)",
                ref(ResponseItemList),
                "400",
                "404-conversation",
            )
            | {"parameters": ITEMS_QUERY},
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "parameters": [CONVERSATION_ID, ITEM_ID],
            "get": json_operation("One item of a conversation", item, "404-item"),
            "delete": json_operation(
                "Delete one item of a conversation; the conversation",
                ref(ConversationObject),
                "404-item",
            ),
        },
    }
