"""An Anthropic conversation (`system` and `messages`) as the chat template takes it.

- `system` (a string, or text blocks joined by newlines) becomes a leading `system` message.
- A message's text blocks are joined by newlines, as the OpenAI chat route joins content parts.
- Consecutive turns of one role are merged into one turn (Anthropic combines them too; many chat
  templates refuse two user turns in a row).
- `tool_use` blocks of an assistant turn become that turn's `tool_calls` (`input` as the
  arguments' JSON text); each `tool_result` block of a user turn becomes a `tool` message (its
  `tool_use_id` as `tool_call_id`; its content, a string or text blocks joined by newlines,
  `Error: ` before it when `is_error`, then its `image` blocks as image parts, which a
  vision-language model whose chat template renders tool messages sees and any other model
  refuses with a 400 naming the block), in the order of the blocks; the turn's other blocks
  (text, images) follow as a user message. `http/tooling.py` renders calls and results as the
  model's template (or the fallback format) takes them.
- `document` blocks of a user turn are text of that turn: their `title`, `context` and text, one
  a line (a `text` source's `data`, or a `content` source's text blocks joined by newlines).
  A PDF (`base64`, `url` or `file` source) is refused (400 naming the source's `type`), and so is
  `citations: {"enabled": true}`: this server produces no citations.
- `image` blocks of a user turn (`source` base64 with `media_type`, or `url`) become image parts
  for the engine's multimodal path: a vision-language model fetches and sees them, a text-only
  model refuses them (400 naming the block's `source`).
- A last `assistant` turn is a prefill: the template renders it open (`continue_final_message`)
  and the answer continues its text; the answer's content holds only the continuation. An empty
  last assistant turn asks for nothing and is left out (kept, closed, when it is the only turn);
  one that holds `tool_use` blocks is rendered closed, and the answer is a new turn.
- `thinking` blocks of assistant turns (an earlier answer's reasoning, sent back) are the turn's
  `reasoning_content` when the model's chat template renders it (`keep_reasoning`: Qwen3-style
  templates show the model its reasoning during a tool loop, what Anthropic keeps thinking blocks
  for), else dropped, as the template would drop them; `redacted_thinking` blocks (nothing to
  read) are dropped. In a user turn they are refused, as are `tool_use` in a user turn and
  `tool_result` or `image` in an assistant turn. `search_result` blocks are refused (400 naming
  the block's `type`).
- `thinking: {"type": "disabled"}` renders the template with `enable_thinking=False` (Qwen3-style
  templates; others ignore it).

Each block is read and checked by `input_blocks.py`; this module puts what it says in its turn.
An error the engine raises about a template message (`messages[k].content[p].image_url`) is
renamed to the request's own field (`messages[i].content[j].source`) by `Conversation.name_field`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from trio_mlx.http.anthropic.input_blocks import (
    document_text,
    image_url,
    required,
    result_content,
    tool_call,
)
from trio_mlx.http.anthropic.requests import (
    LATER_BLOCK_TYPES,
    THINKING_BLOCK_TYPES,
    ContentBlock,
    CountTokensRequest,
)
from trio_mlx.http.errors import APIError

_TEMPLATE_FIELD = re.compile(r"^messages\[(\d+)\](?:\.content\[(\d+)\](\.image_url)?)?")


@dataclass(frozen=True)
class Conversation:
    """Chat-template `messages`, whether the last one is a prefill, the template keywords, and
    where each template message (and media part) came from in the request."""

    messages: list[dict[str, Any]]
    prefill: bool
    template_kwargs: dict[str, Any] | None
    #: per template message: the request field it came from (`system`, `messages[i]`)
    origins: list[str] = field(default_factory=list)
    #: `(template message, part)` -> the request block it came from (`messages[i].content[j]`)
    parts: dict[tuple[int, int], str] = field(default_factory=dict)

    def name_field(self, exc: APIError, added: int = 0) -> None:
        """Rename `exc.param` from a template message's field to the request's; `added`: how
        many messages were put before the conversation's (a system prompt offering tools)."""
        match = _TEMPLATE_FIELD.match(exc.param or "")
        if match is None:
            return
        k = int(match.group(1)) - added
        if not 0 <= k < len(self.origins):
            exc.param = "messages"
            return
        rest = (exc.param or "")[match.end() :]
        if match.group(2) is not None and (k, int(match.group(2))) in self.parts:
            block = self.parts[(k, int(match.group(2)))]
            exc.param = block + (".source" if match.group(3) else "") + rest
        else:
            exc.param = self.origins[k] + (exc.param or "")[len(f"messages[{match.group(1)}]") :]

    @property
    def has_media(self) -> bool:
        return bool(self.parts)


class _Turn:
    """A template message being built: its text and media parts, calls, and origins."""

    def __init__(self, role: str, origin: str, tool_call_id: str | None = None) -> None:
        self.role = role
        self.origin = origin
        self.tool_call_id = tool_call_id
        self.parts: list[dict[str, Any]] = []
        #: part index -> the request block it came from (media parts only)
        self.sources: dict[int, str] = {}
        self.tool_calls: list[dict[str, Any]] = []
        #: the text of the turn's thinking blocks, kept (`keep_reasoning`)
        self.reasoning: list[str] = []

    @property
    def has_text(self) -> bool:
        return any(part["text"] for part in self.parts if part["type"] == "text")

    def merge(self, other: _Turn) -> None:
        offset = len(self.parts)
        self.parts.extend(other.parts)
        self.sources.update({offset + p: where for p, where in other.sources.items()})
        self.tool_calls.extend(other.tool_calls)
        self.reasoning.extend(other.reasoning)

    def message(self) -> dict[str, Any]:
        # With media, the parts themselves (the engine's multimodal path reads them).
        texts = "\n".join(part["text"] for part in self.parts if part["type"] == "text")
        content: str | list[dict[str, Any]] = self.parts if self.sources else texts
        item: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            item["tool_calls"] = self.tool_calls
        if self.reasoning:
            item["reasoning_content"] = "\n".join(self.reasoning)
        if self.tool_call_id is not None:
            item["tool_call_id"] = self.tool_call_id
        return item


def conversation(body: CountTokensRequest, *, keep_reasoning: bool = False) -> Conversation:
    """The request's conversation, refusing with a 400 what this server does not serve.
    `keep_reasoning`: the chat template renders an assistant turn's `reasoning_content`, so the
    turns' thinking blocks are kept as theirs."""
    turns: list[_Turn] = []
    system = body.system
    if isinstance(system, list):
        system = "\n".join(block.text for block in system)
    if system:
        turn = _Turn("system", "system")
        turn.parts.append({"type": "text", "text": system})
        turns.append(turn)
    for i, message in enumerate(body.messages):
        for turn in _message_turns(i, message.role, message.content, keep_reasoning):
            last = turns[-1] if turns else None
            if last is not None and last.role == turn.role and turn.role in ("user", "assistant"):
                last.merge(turn)
            else:
                turns.append(turn)
    if (
        turns[-1].role == "assistant"
        and not turns[-1].has_text
        and not turns[-1].tool_calls
        and len(turns) > 1
    ):
        turns.pop()
    prefill = turns[-1].role == "assistant" and turns[-1].has_text and not turns[-1].tool_calls
    kwargs: dict[str, Any] = {}
    if prefill:
        kwargs["continue_final_message"] = True
    if body.thinking is not None and body.thinking.type == "disabled":
        kwargs["enable_thinking"] = False
    parts = {(k, p): where for k, turn in enumerate(turns) for p, where in turn.sources.items()}
    return Conversation(
        [turn.message() for turn in turns],
        prefill,
        kwargs or None,
        [turn.origin for turn in turns],
        parts,
    )


def _message_turns(
    i: int, role: str, content: str | list[ContentBlock], keep_reasoning: bool
) -> list[_Turn]:
    """The template messages one request message becomes: one turn, or (a user turn with tool
    results) a `tool` message per result and the rest as user turns, in the order given."""
    origin = f"messages[{i}]"
    if isinstance(content, str):
        turn = _Turn(role, origin)
        turn.parts.append({"type": "text", "text": content})
        return [turn]
    out = [_Turn(role, origin)]
    for j, block in enumerate(content):
        where = f"{origin}.content[{j}]"
        if block.type == "text":
            if block.text is None:
                raise APIError(
                    400,
                    "a text block needs `text`",
                    param=f"{where}.text",
                    code="missing_required_parameter",
                )
            if out[-1].role != role:
                out.append(_Turn(role, origin))
            out[-1].parts.append({"type": "text", "text": block.text})
        elif block.type in THINKING_BLOCK_TYPES and role == "assistant":
            if keep_reasoning and block.type == "thinking" and block.thinking:
                out[-1].reasoning.append(block.thinking)
        elif block.type == "tool_use" and role == "assistant":
            out[-1].tool_calls.append(tool_call(block, where))
        elif block.type == "tool_result" and role == "user":
            out.append(_Turn("tool", origin, required(block.tool_use_id, where, "tool_use_id")))
            text, images = result_content(block, where)
            if text or not images:
                out[-1].parts.append({"type": "text", "text": text})
            for image_where, url in images:
                out[-1].sources[len(out[-1].parts)] = image_where
                out[-1].parts.append({"type": "image_url", "image_url": {"url": url}})
        elif block.type == "document" and role == "user":
            if out[-1].role != role:
                out.append(_Turn(role, origin))
            out[-1].parts.append({"type": "text", "text": document_text(block, where)})
        elif block.type == "image" and role == "user":
            if out[-1].role != role:
                out.append(_Turn(role, origin))
            out[-1].sources[len(out[-1].parts)] = where
            image = {"url": image_url(block.source, where)}
            out[-1].parts.append({"type": "image_url", "image_url": image})
        elif block.type in LATER_BLOCK_TYPES:
            raise APIError(
                400,
                f"content blocks of type {block.type!r} are not supported by this server",
                param=f"{where}.type",
                code="unsupported_value",
            )
        else:
            raise APIError(
                400,
                f"a {role} message cannot hold a {block.type!r} block",
                param=f"{where}.type",
                code="invalid_value",
            )
    # A user turn of tool results only: no empty user message after them.
    return [turn for turn in out if turn.parts or turn.tool_calls or len(out) == 1]
