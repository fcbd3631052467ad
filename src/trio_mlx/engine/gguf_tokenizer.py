"""Rebuild a Hugging Face fast tokenizer from the metadata of a GGUF file.

GGUF files carry their tokenizer as metadata (`tokenizer.ggml.*`): the vocabulary, the BPE merges,
each token's type and the chat template. This module turns that metadata into the two files that
`transformers.AutoTokenizer` (and so `mlx_lm.load`) reads: `tokenizer.json` and
`tokenizer_config.json`.

Supported: byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`), the family of SmolLM,
Llama 3, Qwen and GPT-2 style models. SentencePiece vocabularies (`"llama"`) are refused with a
clear error rather than approximated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from trio_mlx.errors import ModelLoadError

#: GGUF token types (llama.cpp's `llama_token_type`): 3 = control, 4 = user-defined.
_SPECIAL_TOKEN_TYPES = frozenset({3, 4})

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        # Digits are split one by one before the GPT-2 pattern.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in ("gpt2", "gpt-2", "default", ""):
        return byte_level
    raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r}")


def _as_list(value: Any) -> list[Any]:
    """A metadata array as a list (whether it came from `read_gguf_header` or `mx.load`)."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        return list(value.tolist())
    return list(value)


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return int(value)


def build_tokenizer(metadata: Mapping[str, Any], *, source: str = "GGUF") -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF file's own tokenizer."""
    model_kind = str(metadata.get("tokenizer.ggml.model", ""))
    if model_kind != "gpt2":
        raise ModelLoadError(
            f"{source}: unsupported tokenizer model {model_kind!r} "
            "(only byte-level BPE vocabularies, tokenizer.ggml.model = 'gpt2', are supported)"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{source}: the GGUF metadata has no tokenizer.ggml.tokens")
    if not isinstance(merges, list):
        raise ModelLoadError(f"{source}: the GGUF metadata has no tokenizer.ggml.merges")
    token_types = _as_list(metadata.get("tokenizer.ggml.token_type"))

    vocab = {str(tok): i for i, tok in enumerate(tokens)}
    merge_pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = str(merge).partition(" ")
        if not sep:
            raise ModelLoadError(f"{source}: malformed BPE merge {merge!r}")
        merge_pairs.append((left, right))

    try:
        bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False)
    except Exception as exc:  # tokenizers raises a bare Exception for an inconsistent vocabulary
        raise ModelLoadError(f"{source}: invalid BPE vocabulary: {exc}") from exc
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [
        str(tokens[i]) for i, kind in enumerate(token_types) if kind in _SPECIAL_TOKEN_TYPES
    ]
    if specials:
        tokenizer.add_special_tokens(
            [AddedToken(s, special=True, normalized=False) for s in specials]
        )
    return tokenizer


def tokenizer_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The `tokenizer_config.json` contents: special tokens and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token_for(key: str) -> str | None:
        index = _as_int(metadata.get(key))
        if index is None or not 0 <= index < len(tokens):
            return None
        return str(tokens[index])

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": _as_int(
            metadata.get(f"{metadata.get('general.architecture', 'llama')}.context_length")
        )
        or 2048,
        "add_bos_token": bool(_as_int(metadata.get("tokenizer.ggml.add_bos_token")) or 0),
        "add_eos_token": bool(_as_int(metadata.get("tokenizer.ggml.add_eos_token")) or 0),
    }
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        token = token_for(key)
        if token is not None:
            config[name] = token
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config


def write_tokenizer_files(metadata: Mapping[str, Any], out_dir: Path, *, source: str) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for the GGUF metadata into `out_dir`."""
    tokenizer = build_tokenizer(metadata, source=source)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(metadata)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special = {
        k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in config
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
