"""Incremental detokenization that never emits a broken UTF-8 sequence.

A byte-level BPE token can end in the middle of a multi-byte character, and SentencePiece decoders
change a token's text depending on what precedes it. So each new piece of text is the difference
between two decodes that start at the same earlier token (`prefix_offset`): the text up to the
last emitted token and the text up to the newest one. Text ending in U+FFFD (an incomplete
character) is held back until the tokens that complete it arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


def decoder_for(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """The fastest exact `ids -> text` function for a (possibly mlx-lm wrapped) HF tokenizer.

    Special tokens are skipped, as OpenAI-compatible servers do.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    raw = getattr(hf, "_tokenizer", None)
    if (
        raw is not None
        and hasattr(raw, "decode")
        and not getattr(hf, "clean_up_tokenization_spaces", False)
    ):
        raw_decode = raw.decode
        return lambda ids: str(raw_decode(list(ids), skip_special_tokens=True))
    hf_decode = hf.decode
    return lambda ids: str(hf_decode(list(ids), skip_special_tokens=True))


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
