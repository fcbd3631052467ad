"""A request's input items as a stored response keeps them, and the stored responses' routes:
`GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

Kept items have OpenAI's shapes, as `input_items` lists them and as a later turn reads them back
(`InputItem`): each has an `id` (the client's, or a new `msg_`, `fc_`, `fco_`, `rs_` one) and a
`status`; a message's text given as a string is kept as one text part (`input_text`, or
`output_text` for an assistant's), which the chat template renders as the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from trio_mlx.http.errors import APIError, from_validation_error
from trio_mlx.http.generation import new_id
from trio_mlx.http.objects import ResponseDeleted, ResponseItemList
from trio_mlx.http.requests import _Body
from trio_mlx.http.responses.requests import InputItem
from trio_mlx.http.responses.store import ResponseStore, StoredResponse, response_not_found

#: The `id` prefix of a kept item that came without one, by type.
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def own_items(input: str | Sequence[InputItem] | None) -> list[InputItem]:
    """A request's `input` as items: a string is one user message."""
    if input is None:
        return []
    if isinstance(input, str):
        return [InputItem(type="message", role="user", content=input)]
    return list(input)


def kept_item(item: InputItem) -> dict[str, Any]:
    """An input item as a stored response keeps it (see the module docstring)."""
    kept = item.model_dump(mode="json", exclude_none=True, exclude={"reasoning_parts"})
    kept.setdefault("id", new_id(_ID_PREFIXES[item.type]))
    kept.setdefault("status", "completed")
    if item.type == "reasoning":
        kept.setdefault("summary", [])
        if item.reasoning_parts is not None:
            kept["content"] = item.reasoning_parts
    elif item.type == "message" and isinstance(item.content, str):
        if item.role == "assistant":
            kept["content"] = [{"type": "output_text", "text": item.content, "annotations": []}]
        else:
            kept["content"] = [{"type": "input_text", "text": item.content}]
    elif item.type == "message" and isinstance(kept.get("content"), list):
        for part in kept["content"]:  # as the response's own output_text parts have them
            if part.get("type") == "output_text":
                part.setdefault("annotations", [])
    return kept


def stored_response(store: ResponseStore, response_id: str) -> StoredResponse:
    """A stored response, or the 404 of an id that is not stored."""
    stored = store.get(response_id)
    if stored is None:
        raise response_not_found(response_id)
    return stored


def delete_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """`DELETE /v1/responses/{id}`: OpenAI's deletion object; the 404 of an id not stored."""
    if not store.delete(response_id):
        raise response_not_found(response_id)
    return ResponseDeleted(id=response_id).dump()


class InputItemsQuery(_Body):
    """The query of `GET /v1/responses/{id}/input_items` (strings, read as their types)."""

    model_config = ConfigDict(strict=False)

    after: str | None = Field(default=None, description="List the items after this item's id.")
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"


def input_items_page(
    store: ResponseStore, response_id: str, query: dict[str, str]
) -> dict[str, Any]:
    """One page of a stored response's input items (`ResponseItemList`), in `order` (`desc`,
    the newest first, by default), from the item after `after`, at most `limit`. `include` is
    accepted and adds nothing: the items are kept whole."""
    asked = read_items_query(query)
    items = list(stored_response(store, response_id).input_items)
    return items_page(items, asked, f"no input item {asked.after!r} in response {response_id!r}")


def read_items_query(query: dict[str, str]) -> InputItemsQuery:
    """A list route's query (`after`, `limit`, `order`), or the 400 naming the field."""
    try:
        return InputItemsQuery.model_validate(query)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


#: The code of the 400 for an `after` that names no item of the list.
AFTER_NOT_FOUND = "after_not_found"


def items_page(items: list[dict[str, Any]], asked: InputItemsQuery, unknown: str) -> dict[str, Any]:
    """One page of `items` (oldest first) as `asked` (`ResponseItemList`); `unknown`: the 400's
    message for an `after` that is none of their ids."""
    items = list(items)
    if asked.order == "desc":
        items.reverse()
    start = 0
    if asked.after is not None:
        ids = [item.get("id") for item in items]
        if asked.after not in ids:
            raise APIError(400, unknown, param="after", code=AFTER_NOT_FOUND)
        start = ids.index(asked.after) + 1
    page = items[start : start + asked.limit]
    return ResponseItemList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=start + asked.limit < len(items),
    ).dump()
