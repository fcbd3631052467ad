"""Prompts to token ids: plain text, token ids given by the caller, and chat messages rendered
through the model's chat template. Pure tokenizer work (no MLX): safe on any thread."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trio_mlx.errors import InvalidRequest

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def encode_text(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids for a raw text prompt; BOS is added unless the text already starts with it."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))


def check_token_ids(ids: object, vocab_size: int, *, param: str = "prompt") -> list[int]:
    """The caller's token ids (a list or tuple of ints), validated against the vocabulary."""
    if not isinstance(ids, list | tuple):
        raise InvalidRequest(f"{param} must be a string or a list of token ids", param=param)
    out: list[int] = []
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequest(
                f"token id at position {i} ({t!r}) is not in the vocabulary (0..{vocab_size - 1})",
                param=param,
            )
        out.append(t)
    return out


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages in the shape chat templates expect: `content` as a string.

    Accepts OpenAI content parts (`[{"type": "text", "text": ...}]`); other part types are refused
    by this text-only path.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, Sequence):
            pieces = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text"):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}]: only text content parts are supported",
                        param=f"messages[{i}].content[{j}]",
                    )
                piece = part.get("text")
                if not isinstance(piece, str):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}].text must be a string",
                        param=f"messages[{i}].content[{j}].text",
                    )
                pieces.append(piece)
            text = "".join(pieces)
        else:
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of content parts",
                param=f"messages[{i}].content",
            )
        normalized = {k: v for k, v in message.items() if k != "content"}
        normalized["role"] = "system" if role == "developer" else role
        normalized["content"] = text
        out.append(normalized)
    return out


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered by the model's chat template, ready for the reply."""
    normalized = normalize_messages(messages)
    if not getattr(tokenizer, "has_chat_template", False) and not getattr(
        tokenizer, "chat_template", None
    ):
        raise InvalidRequest("this model has no chat template; use a text prompt", param="messages")
    kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = list(tools)
    try:
        text = tokenizer.apply_chat_template(
            normalized, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except InvalidRequest:
        raise
    except Exception as exc:  # a template's own `raise_exception(...)` or a Jinja error
        raise InvalidRequest(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return list(tokenizer.encode(text, add_special_tokens=False))
