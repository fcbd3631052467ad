"""A tool call as every surface reports it (OpenAI `tool_calls`, Responses `function_call`,
Anthropic `tool_use`), whichever way it was produced: parsed from a model family's markup or
generated under a grammar that forces a call."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


def new_call_id(prefix: str = "call_") -> str:
    """A fresh call id: `prefix` and 24 random hex digits."""
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool. `arguments` is the JSON text of the arguments object (as
    OpenAI's `function.arguments`), `"{}"` for a call without arguments."""

    name: str
    arguments: str = "{}"
    id: str = field(default_factory=new_call_id)
