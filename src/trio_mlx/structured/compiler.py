"""Compiling an `OutputFormat` into a grammar for one tokenizer, with a bounded LRU cache.

The grammar library is llguidance: it compiles a 20-field JSON schema in about a millisecond
(outlines-core builds its token index for the same schema in 1.4 s on SmolLM2's 49k vocabulary),
computes a token mask in tens of microseconds, and its masks are a plain numpy bitmask, so the
constraint works on every MLX backend. A compiled grammar is the library's matcher in its
initial state, its first mask already computed once (which builds the lexer states every later
copy shares); a request runs on a copy (`CompiledGrammar.matcher`).

Where it runs: in request preparation, on the engine's worker thread (never the event loop, never
the runner thread). One compiler serves one tokenizer; `compile` is thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance

from trio_mlx.bounded_map import BoundedMap
from trio_mlx.errors import InvalidRequest
from trio_mlx.structured.formats import OutputFormat
from trio_mlx.structured.matcher import GrammarMatcher

#: Compiled grammars kept per tokenizer (least recently used dropped first).
DEFAULT_CACHE_SIZE = 128

#: How JSON is written under a schema: the usual separators and no other whitespace, so that a
#: model cannot fill its token budget with blanks between two values (and a small model's
#: output stays close to the JSON it has seen).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class OutputFormatError(InvalidRequest):
    """An output format the grammar library cannot compile (or enforce for this tokenizer)."""

    code = "invalid_output_format"


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A format compiled for one tokenizer. Immutable and shared by every request using it."""

    format: OutputFormat
    #: llguidance's matcher in its initial state (never advanced: copied per request)
    template: Any
    #: 32-bit words in one token mask (the tokenizer's vocabulary, rounded up)
    mask_words: int

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, owned by one request."""
        return GrammarMatcher(self.template.deep_copy(), self.mask_words)


@dataclass(frozen=True)
class GrammarCacheInfo:
    hits: int
    misses: int
    size: int
    capacity: int


class GrammarCompiler:
    """Compiles formats for `tokenizer` (a Hugging Face fast tokenizer, or mlx-lm's wrapper of
    one). The tokenizer is converted for the grammar library on the first compile (about
    0.4 s for a 49k vocabulary), not before: a server that never constrains never pays it.

    `eos_token_ids`: the tokens that end a generation; a grammar that is complete allows any of
    them (default: the tokenizer's `eos_token_ids`, else its `eos_token_id`).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_ids: Iterable[int] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 1:
            raise ValueError("the grammar cache needs room for at least one grammar")
        self._tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", None)
        self._eos = sorted({int(t) for t in eos_token_ids}) if eos_token_ids else None
        self._capacity = cache_size
        #: Least recently used first, bounded by count alone (each entry put as 0 bytes).
        self._cache: BoundedMap[OutputFormat, CompiledGrammar] = BoundedMap(cache_size, 0)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._hits = 0
        self._misses = 0

    def compile(self, fmt: OutputFormat) -> CompiledGrammar:
        """The compiled grammar of `fmt` (from the cache when it was compiled before).
        `OutputFormatError` (an `InvalidRequest`) naming `fmt.param` when it cannot be compiled
        (bad schema, regex or grammar; keywords a strict schema uses that cannot be enforced; a
        tokenizer the grammar library cannot read)."""
        with self._lock:
            hit = self._cache.get(fmt)
            if hit is not None:
                self._cache.touch(fmt)
                self._hits += 1
                return hit if hit.format.param == fmt.param else _renamed(hit, fmt)
            self._misses += 1
            ll_tokenizer = self._grammar_tokenizer(fmt.param)
        compiled = _compile(fmt, ll_tokenizer)
        with self._lock:
            self._cache.put(fmt, compiled, 0)
        return compiled

    def cache_info(self) -> GrammarCacheInfo:
        with self._lock:
            return GrammarCacheInfo(self._hits, self._misses, len(self._cache), self._capacity)

    def _grammar_tokenizer(self, param: str) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=self._eos)
            except Exception as exc:
                raise OutputFormatError(
                    "structured output needs a fast (Rust) Hugging Face tokenizer, which this "
                    f"model does not have ({type(exc).__name__}: {exc})",
                    param=param,
                ) from exc
        return self._ll_tokenizer


def _renamed(compiled: CompiledGrammar, fmt: OutputFormat) -> CompiledGrammar:
    return CompiledGrammar(fmt, compiled.template, compiled.mask_words)


def _grammar_text(fmt: OutputFormat) -> str:
    if fmt.kind in ("json_schema", "json_object"):
        options: Any = dict(JSON_OPTIONS, lenient=not fmt.strict)
        try:
            text: str = llguidance.LLMatcher.grammar_from_json_schema(
                fmt.schema or {}, defaults=options
            )
        except ValueError as exc:
            raise OutputFormatError(f"invalid JSON schema: {exc}", param=fmt.param) from exc
        return text
    if fmt.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(fmt.source))
    return str(llguidance.LLMatcher.grammar_from_lark(fmt.source))


_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regular expression",
    "lark": "Lark grammar",
}


def _compile(fmt: OutputFormat, ll_tokenizer: Any) -> CompiledGrammar:
    import numpy as np

    grammar = _grammar_text(fmt)
    what = _WHAT[fmt.kind]
    template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    if template.is_error():
        raise OutputFormatError(
            f"the {what} cannot be enforced: {_first_line(template.get_error())}", param=fmt.param
        )
    words = (int(ll_tokenizer.vocab_size) + 31) // 32
    first = np.frombuffer(template.compute_bitmask(), dtype=np.uint32)
    if template.is_error() or not first.any():
        reason = _first_line(template.get_error()) or "no output satisfies it"
        raise OutputFormatError(f"the {what} cannot be enforced: {reason}", param=fmt.param)
    template.reset()
    return CompiledGrammar(fmt, template, words)


def _first_line(message: str) -> str:
    """llguidance's errors end with a source excerpt; the first lines say what is wrong."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3])[:500]
