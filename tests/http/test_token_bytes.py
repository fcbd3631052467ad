"""Logprobs' `bytes`: each token's own bytes, so that a client joins a character split across
tokens (the bundled SmolLM2 tokenizer: byte-level BPE)."""

from __future__ import annotations

from pathlib import Path

from trio_mlx.engine.loading import load_model
from trio_mlx.http.generation import TokenText

TEXT = "Grüße aus 東京 🙂, naïve café"


def test_the_tokens_bytes_join_into_the_text(tiny_model_dir: Path) -> None:
    tokenizer = load_model(tiny_model_dir).tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text = TokenText(tokenizer)
    assert b"".join(bytes(text.bytes(t)) for t in ids) == TEXT.encode("utf-8")
    # Some token holds only part of a character: decoded alone it is U+FFFD, which is why the
    # bytes come from the vocabulary and not from the token's own text.
    split = [t for t in ids if "\ufffd" in text(t)]
    assert split
    assert all(bytes(text.bytes(t)) != "\ufffd".encode() for t in split)
    # Whole tokens keep the bytes of their text.
    whole = [t for t in ids if "\ufffd" not in text(t)]
    assert all(bytes(text.bytes(t)).decode("utf-8") == text(t) for t in whole)


def test_special_tokens_are_their_text(tiny_model_dir: Path) -> None:
    tokenizer = load_model(tiny_model_dir).tokenizer
    text = TokenText(tokenizer)
    for token in tokenizer.all_special_ids:
        assert bytes(text.bytes(token)).decode("utf-8") == text(token)
