"""An Anthropic conversation (`system` and `messages`) as the chat template takes it.

- `system` (a string, or text blocks joined by newlines) becomes a leading `system` message.
- A message's text blocks are joined by newlines, as the OpenAI chat route joins content parts.
- Consecutive turns of one role are merged into one turn (Anthropic combines them too; many chat
  templates refuse two user turns in a row).
- A last `assistant` turn is a prefill: the template renders it open (`continue_final_message`)
  and the answer continues its text; the answer's content holds only the continuation. An empty
  last assistant turn asks for nothing and is left out (kept, closed, when it is the only turn).
- `thinking` and `redacted_thinking` blocks of assistant turns are dropped; in a user turn they
  are refused. Image, document and tool blocks are refused (400 naming the block's `type`) until
  this server serves them.
- `thinking: {"type": "disabled"}` renders the template with `enable_thinking=False` (Qwen3-style
  templates; others ignore it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trio_mlx.http.anthropic.requests import (
    LATER_BLOCK_TYPES,
    THINKING_BLOCK_TYPES,
    CountTokensRequest,
    MessageParam,
)
from trio_mlx.http.errors import APIError


@dataclass(frozen=True)
class Conversation:
    """Chat-template `messages`, whether the last one is a prefill, and the template keywords."""

    messages: list[dict[str, Any]]
    prefill: bool
    template_kwargs: dict[str, Any] | None


def conversation(body: CountTokensRequest) -> Conversation:
    """The request's conversation, refusing with a 400 what this server does not serve."""
    turns: list[dict[str, Any]] = []
    system = body.system
    if isinstance(system, list):
        system = "\n".join(block.text for block in system)
    if system:
        turns.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        text = _message_text(i, message)
        if len(turns) > 0 and turns[-1]["role"] == message.role:
            turns[-1]["content"] += "\n" + text
        else:
            turns.append({"role": message.role, "content": text})
    if turns[-1]["role"] == "assistant" and not turns[-1]["content"] and len(turns) > 1:
        turns.pop()
    prefill = turns[-1]["role"] == "assistant" and bool(turns[-1]["content"])
    kwargs: dict[str, Any] = {}
    if prefill:
        kwargs["continue_final_message"] = True
    if body.thinking is not None and body.thinking.type == "disabled":
        kwargs["enable_thinking"] = False
    return Conversation(turns, prefill, kwargs or None)


def _message_text(i: int, message: MessageParam) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if block.type == "text":
            if block.text is None:
                raise APIError(
                    400,
                    "a text block needs `text`",
                    param=f"{where}.text",
                    code="missing_required_parameter",
                )
            texts.append(block.text)
        elif block.type in THINKING_BLOCK_TYPES and message.role == "assistant":
            continue  # an earlier answer's reasoning: dropped, as Anthropic drops it
        elif block.type in LATER_BLOCK_TYPES:
            raise APIError(
                400,
                f"content blocks of type {block.type!r} are not supported by this server yet "
                "(text only)",
                param=f"{where}.type",
                code="unsupported_value",
            )
        else:
            raise APIError(
                400,
                f"a {message.role} message cannot hold a {block.type!r} block",
                param=f"{where}.type",
                code="invalid_value",
            )
    return "\n".join(texts)
