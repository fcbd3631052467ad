"""Request bodies of the Conversations API, and the check of the items they add.

Items are the Responses API's input items (`responses.requests.InputItem`), checked as a
Responses request's `input` is (`responses.conversation.input_messages`: the fields each type
needs, its content parts, a media part's source), so that every item a conversation holds can
be a later response's context; a refused item is a 400 naming it (`items[3].content`).
`metadata` has OpenAI's bounds: at most 16 keys of at most 64 characters, values of at most 512.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StringConstraints

from trio_mlx.errors import InvalidRequest
from trio_mlx.http.errors import from_engine_error
from trio_mlx.http.requests import _Body
from trio_mlx.http.responses.conversation import input_messages, name_input_field
from trio_mlx.http.responses.items import kept_item
from trio_mlx.http.responses.requests import InputItem
from trio_mlx.multimodal.parts import has_media, split_media

#: Items one request may add (`POST /v1/conversations`, `.../items`), as at OpenAI.
MAX_ITEMS = 20

Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=512)],
    ],
    Field(
        max_length=16,
        description="At most 16 keys of at most 64 characters; values of at most 512.",
    ),
]


class ConversationCreateRequest(_Body):
    """`POST /v1/conversations`."""

    items: Annotated[
        list[InputItem] | None,
        Field(
            max_length=MAX_ITEMS,
            description="The conversation's first items (input items, as a response's "
            "`input` has them), at most 20.",
        ),
    ] = None
    metadata: Metadata | None = None


class ConversationUpdateRequest(_Body):
    """`POST /v1/conversations/{conversation_id}`: its metadata replaced (null: emptied)."""

    model_config = ConfigDict(json_schema_extra={"required": ["metadata"]})

    metadata: Metadata | None


class ConversationItemsRequest(_Body):
    """`POST /v1/conversations/{conversation_id}/items`."""

    items: Annotated[
        list[InputItem],
        Field(
            min_length=1,
            max_length=MAX_ITEMS,
            description="Items to append (input items, as a response's `input` has them), "
            "at most 20.",
        ),
    ]


def checked_items(items: Sequence[InputItem] | None, field: str = "items") -> list[dict[str, Any]]:
    """`items` checked as a response's input would be, in the shape a conversation keeps them
    (each with an `id`); a 400 naming `field[i]` for one that is refused."""
    if not items:
        return []
    messages, where = input_messages(None, items, [f"{field}[{i}]" for i in range(len(items))])
    if has_media(messages):  # a media part's source, as the engine would read it
        try:
            split_media(messages)
        except InvalidRequest as exc:
            error = from_engine_error(exc)
            name_input_field(error, where)
            raise error from None
    return [kept_item(item) for item in items]
