"""The slow, obvious way to find a chat's system-prompt boundary: an oracle for
`prompts.chat_prompt(..., find_system_prefix=True)`, which finds it in one pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trio_mlx.engine.prompts import chat_prompt, normalize_messages
from trio_mlx.errors import InvalidRequest


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of `messages` through the chat template, ready for the reply."""
    return chat_prompt(tokenizer, messages).tokens


def system_prefix_length(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], prompt_tokens: Sequence[int]
) -> int | None:
    """How many leading tokens of `prompt_tokens` render only the leading system message(s),
    found by rendering those alone (no generation prompt) and tokenizing them on their own: a
    boundary only where their tokens are a proper prefix of the prompt's. None when there is no
    leading system message or the template refuses a conversation of only system messages."""
    try:
        normalized = normalize_messages(messages)
    except InvalidRequest:
        return None
    count = 0
    while count < len(normalized) and normalized[count]["role"] == "system":
        count += 1
    if count == 0:
        return None
    try:
        text = tokenizer.apply_chat_template(
            normalized[:count], tokenize=False, add_generation_prompt=False
        )
    except Exception:
        return None
    system = tuple(tokenizer.encode(text, add_special_tokens=False))
    if not 0 < len(system) < len(prompt_tokens) or tuple(prompt_tokens[: len(system)]) != system:
        return None
    return len(system)
