"""`GET /v1/models` and `GET /v1/models/{name}` for Anthropic's clients, in Anthropic's shape.

The official `anthropic` clients list models at the same path as OpenAI's and send
`anthropic-version` on every call; their `client.models.list()` reads a page `{"data", "has_more",
"first_id", "last_id"}` of `{"type": "model", "id", "display_name", "created_at", ...}` (RFC 3339
time), which the OpenAI shape (`object`, `created` as a Unix time, `owned_by`) does not fill: the
SDK's `ModelInfo.created_at` and `display_name` were None. A request with `anthropic-version` gets
this shape (`request_ids.speaks_anthropic`); any other, OpenAI's.

A model is each name the server answers to (`--served-model-name`, the first the canonical one):
`display_name` is the name, `created_at` the server's start, `max_input_tokens` the model's
context. The list pages as Anthropic's does: `limit` (1 to 1000, 20 by default), `after_id` (the
models after that one), `before_id` (the models before it); a page says whether more follow the
way it was asked for (`has_more`). An unknown id in `after_id` / `before_id` is a 400 naming it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Literal

from trio_mlx.http.anthropic.objects import AnthropicObject
from trio_mlx.http.errors import APIError
from trio_mlx.http.state import ServerState

DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


class ModelInfo(AnthropicObject):
    type: Literal["model"] = "model"
    id: str
    display_name: str
    #: RFC 3339: when the server started serving it
    created_at: str
    lifecycle: Literal["active"] = "active"
    max_input_tokens: int | None = None


class ModelPage(AnthropicObject):
    data: list[ModelInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None


def model_info(state: ServerState, name: str) -> dict[str, Any]:
    """`GET /v1/models/{name}` (`name` one the server answers to: `state.engine_for` checked)."""
    return _info(state, name).dump()


def model_page(state: ServerState, query: Mapping[str, str]) -> dict[str, Any]:
    """`GET /v1/models`: one page of the names the server answers to (see the module docstring)."""
    names = state.model_names
    limit = _limit(query.get("limit"))
    after, before = query.get("after_id"), query.get("before_id")
    if before is not None:
        end = _position(names, before, "before_id")
        chosen = names[max(0, end - limit) : end]
        more = end - limit > 0
    else:
        start = 0 if after is None else _position(names, after, "after_id") + 1
        chosen = names[start : start + limit]
        more = start + limit < len(names)
    return ModelPage(
        data=[_info(state, name) for name in chosen],
        has_more=more,
        first_id=chosen[0] if chosen else None,
        last_id=chosen[-1] if chosen else None,
    ).dump()


def _info(state: ServerState, name: str) -> ModelInfo:
    created = datetime.datetime.fromtimestamp(state.created, tz=datetime.UTC)
    engine = state.engine
    return ModelInfo(
        id=name,
        display_name=name,
        created_at=created.isoformat().replace("+00:00", "Z"),
        max_input_tokens=engine.context_length if engine is not None else None,
    )


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise APIError(
            400,
            f"limit must be an integer from 1 to {MAX_LIMIT}",
            param="limit",
            code="invalid_value",
        )
    return limit


def _position(names: list[str], name: str, param: str) -> int:
    if name not in names:
        raise APIError(
            400,
            f"{param} names no model of this server: {name!r}",
            param=param,
            code="invalid_value",
        )
    return names.index(name)
