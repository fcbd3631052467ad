"""Prompts to token ids: plain text, token ids given by the caller, and chat messages rendered
through the model's chat template. Pure tokenizer work (no MLX): safe on any thread."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ChatPrompt:
    """A chat rendered and tokenized: its `tokens`, and `system_prefix`, how many leading tokens
    render the leading system message(s) alone (None when unknown or not a clean boundary)."""

    tokens: list[int]
    system_prefix: int | None = None


class SystemPromptTokens:
    """The tokens of rendered system prompts already seen, so that a later chat with the same
    system prompt tokenizes only what follows it (agents resend long system prompts on every
    request; tokenizing 2,000 tokens costs milliseconds of the time to first token).

    Exact by construction and by check: an entry is used only where the text after the system
    part starts with one of the tokenizer's added tokens (fast tokenizers split those out before
    normalizing or pre-tokenizing, so what precedes them is tokenized on its own), and an entry
    is made only after checking, on the request that makes it, that the system part's tokens
    followed by the rest's tokens equal the tokens of the whole text. If that check ever fails,
    this tokenizer is not split that way again (`disabled`). At most `max_entries`, least
    recently used first out. Used on one thread (the Trio thread).
    """

    def __init__(self, tokenizer: Any, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self.disabled = False
        self.hits = 0
        self._entries: dict[str, tuple[int, ...]] = {}
        added = getattr(tokenizer, "get_added_vocab", None)
        vocab = added() if callable(added) else {}
        self._added = tuple(sorted((t for t in vocab if isinstance(t, str) and t), key=len))

    def splits_before(self, rest: str) -> bool:
        """Whether `rest` starts with an added token (where a split can be exact)."""
        return not self.disabled and any(rest.startswith(token) for token in self._added)

    def lookup(self, system_text: str) -> tuple[int, ...] | None:
        tokens = self._entries.pop(system_text, None)
        if tokens is not None:
            self._entries[system_text] = tokens  # most recently used last
            self.hits += 1
        return tokens

    def offer(
        self, system_text: str, tokens: Sequence[int], boundary: int, rest_tokens: Sequence[int]
    ) -> None:
        """Keep `tokens[:boundary]` for `system_text` if the check holds (see the class)."""
        if list(tokens[:boundary]) + list(rest_tokens) != list(tokens):
            self.disabled = True
            self._entries.clear()
            return
        self._entries[system_text] = tuple(tokens[:boundary])
        while len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    find_system_prefix: bool = False,
    known_systems: SystemPromptTokens | None = None,
) -> ChatPrompt:
    """`messages` rendered by the model's chat template and tokenized, ready for the reply; with
    `find_system_prefix`, also where the system prompt ends in the tokens.

    The boundary costs one tokenization, not two, where the tokenizer reports character offsets
    (a Hugging Face fast tokenizer): the system messages are rendered alone, and if the full text
    starts with that text and a token ends exactly there, that token count is the boundary.
    Otherwise it tokenizes the system part on its own and checks that its tokens are a prefix.
    With `known_systems`, a system prompt seen before is not tokenized again (see there).

    `chat_template_kwargs={"continue_final_message": True}` (Hugging Face's name) renders the
    last message open, without a generation prompt, so that the reply continues it: an
    assistant prefill.
    """
    normalized = normalize_messages(messages)
    if not getattr(tokenizer, "has_chat_template", False) and not getattr(
        tokenizer, "chat_template", None
    ):
        raise InvalidRequest("this model has no chat template; use a text prompt", param="messages")
    kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = list(tools)
    check_reasoning_rendered(tokenizer, normalized, kwargs)
    try:
        text = tokenizer.apply_chat_template(
            normalized,
            tokenize=False,
            add_generation_prompt=not kwargs.get("continue_final_message"),
            **kwargs,
        )
    except InvalidRequest:
        raise
    except Exception as exc:  # a template's own `raise_exception(...)` or a Jinja error
        raise InvalidRequest(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    if not find_system_prefix:
        return ChatPrompt(list(tokenizer.encode(text, add_special_tokens=False)))
    system_text = _render_system_part(tokenizer, normalized, kwargs)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if system_text is None or backend is None:
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        if system_text is None:
            return ChatPrompt(tokens)
        return ChatPrompt(tokens, _system_tokens_prefix(tokenizer, system_text, tokens))
    end = len(system_text)
    rest = text[end:] if text.startswith(system_text) else None
    split = rest is not None and known_systems is not None and known_systems.splits_before(rest)
    if split:
        assert known_systems is not None and rest is not None
        known = known_systems.lookup(system_text)
        if known is not None:
            tail = backend.encode(rest, add_special_tokens=False).ids
            return ChatPrompt([*known, *tail], len(known))
    encoding = backend.encode(text, add_special_tokens=False)
    tokens = list(encoding.ids)
    if rest is None:
        return ChatPrompt(tokens)
    boundary = None
    for index, (_start, stop) in enumerate(encoding.offsets):
        if stop >= end:
            boundary = index + 1 if stop == end else None
            break
    if boundary is not None and not 0 < boundary < len(tokens):
        boundary = None
    if boundary is not None and split:
        assert known_systems is not None
        rest_tokens = backend.encode(rest, add_special_tokens=False).ids
        known_systems.offer(system_text, tokens, boundary, rest_tokens)
    return ChatPrompt(tokens, boundary)


def renders_reasoning(tokenizer: Any, chat_template: Any = None) -> bool:
    """Whether the chat template (`chat_template`, else the tokenizer's) renders an earlier
    assistant turn's `reasoning_content`: it names the field."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    return "reasoning_content" in str(template)


def check_reasoning_rendered(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]
) -> None:
    """Refuse a message's `reasoning_content` that the chat template would silently drop.

    A template that renders earlier turns' reasoning names the field (`message.reasoning_content`
    in Qwen3's and DeepSeek's); one that does not name it drops the text, and the model would
    see a different conversation than the caller sent: `InvalidRequest` naming the field."""
    if renders_reasoning(tokenizer, kwargs.get("chat_template")):
        return
    for i, message in enumerate(messages):
        if message.get("reasoning_content"):
            raise InvalidRequest(
                f"messages[{i}].reasoning_content: this model's chat template does not render "
                "reasoning, so it would be dropped; leave it out of the message",
                param=f"messages[{i}].reasoning_content",
            )


def _render_system_part(
    tokenizer: Any, normalized: list[dict[str, Any]], kwargs: Mapping[str, Any]
) -> str | None:
    """The leading system message(s) rendered alone, without a generation prompt; None when
    there are none or the template refuses a conversation of only system messages."""
    count = 0
    while count < len(normalized) and normalized[count]["role"] == "system":
        count += 1
    if count == 0:
        return None
    # The system part is rendered closed, whatever the last message is.
    kwargs = {k: v for k, v in kwargs.items() if k != "continue_final_message"}
    try:
        text = tokenizer.apply_chat_template(
            normalized[:count], tokenize=False, add_generation_prompt=False, **kwargs
        )
    except Exception:  # a template that insists on a user turn, or any Jinja error
        return None
    return text if isinstance(text, str) and text else None


def _system_tokens_prefix(
    tokenizer: Any, system_text: str, prompt_tokens: Sequence[int]
) -> int | None:
    system = tuple(tokenizer.encode(system_text, add_special_tokens=False))
    if not 0 < len(system) < len(prompt_tokens):
        return None
    if tuple(prompt_tokens[: len(system)]) != system:
        return None
    return len(system)
