"""Incremental detokenization that never emits a broken UTF-8 sequence.

A byte-level BPE token can end in the middle of a multi-byte character, and SentencePiece decoders
change a token's text depending on what precedes it. So each new piece of text is the difference
between two decodes that start at the same earlier token (`prefix_offset`): the text up to the
last emitted token and the text up to the newest one. Text ending in U+FFFD (an incomplete
character) is held back until the tokens that complete it arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


def decoder_for(tokenizer: Any, keep: Collection[str] = ()) -> Callable[[Sequence[int]], str]:
    """The fastest exact `ids -> text` function for a (possibly mlx-lm wrapped) HF tokenizer.

    Special tokens are skipped, as OpenAI-compatible servers do, except those whose text is in
    `keep`: the markup of tool calls, which some families write as special tokens (Mistral's
    `[TOOL_CALLS]`, Kimi's and gpt-oss's markers, Llama's `<|python_tag|>`) and which the call
    parsers must see.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    dropped = _special_ids(hf, keep) if keep else None
    raw = getattr(hf, "_tokenizer", None)
    if (
        raw is not None
        and hasattr(raw, "decode")
        and not getattr(hf, "clean_up_tokenization_spaces", False)
    ):
        raw_decode = raw.decode
        if dropped is not None:
            return lambda ids: str(
                raw_decode([i for i in ids if i not in dropped], skip_special_tokens=False)
            )
        return lambda ids: str(raw_decode(list(ids), skip_special_tokens=True))
    hf_decode = hf.decode
    if dropped is not None:
        return lambda ids: str(
            hf_decode([i for i in ids if i not in dropped], skip_special_tokens=False)
        )
    return lambda ids: str(hf_decode(list(ids), skip_special_tokens=True))


def _special_ids(hf: Any, keep: Collection[str]) -> frozenset[int] | None:
    """The ids of special tokens to skip when those in `keep` are kept; None when the
    tokenizer has none of `keep` as a special token (plain skipping then does the same)."""
    special: dict[int, str] = {}
    added = getattr(hf, "added_tokens_decoder", None)
    if added is None and hasattr(hf, "get_added_tokens_decoder"):  # a `tokenizers.Tokenizer`
        added = hf.get_added_tokens_decoder()
    if isinstance(added, dict):
        for token_id, token in added.items():
            if getattr(token, "special", False):
                special[int(token_id)] = str(getattr(token, "content", token))
    for token_id in getattr(hf, "all_special_ids", None) or ():  # transformers' own list
        special.setdefault(int(token_id), str(hf.convert_ids_to_tokens(int(token_id))))
    if not any(text in keep for text in special.values()):
        return None
    return frozenset(i for i, text in special.items() if text not in keep)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; `text` is always valid Unicode."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def add(self, token: int) -> str:
        """Add one token; return the text it completes (empty while a character is split)."""
        self._tokens.append(token)
        window = self._tokens[self._prefix_offset :]
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(window)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back, decoded as best it can be."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text += delta
        return delta
