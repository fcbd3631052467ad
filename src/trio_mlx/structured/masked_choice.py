"""The masked choice: a constrained row's token from its logits and its grammar's packed mask,
with as little device work and host dispatch as MLX allows. Runner thread only.

Why: on a launch-bound GPU (the H200: each kernel costs 10-50 µs of host dispatch, and decode is
host-bound) the mask spelled out in plain MLX operations (`matcher.apply_token_mask`: the mask
words and a shift table copied over, shift, and, cast, `where`, then the argmax) costs five
kernels and three copies a step: 302 µs evaluated alone against 67 µs for the plain argmax, and
1.16x the plain step end to end on synthetic Llama-3.2-1B bf16. Here:

- `forced_tokens`: the one token a mask allows, per row, read on the host from the packed words
  (no unpacking: one non-zero word holding one bit). A greedy row that nothing but its mask
  shapes (no logits processor, bias or penalty) takes it as its choice with no device work at
  all: the argmax over one allowed token is that token. JSON under a schema is full of such
  steps (keys, separators, closing brackets);
- `masked_argmax`: the argmax over the allowed tokens. The words go to the device packed (4
  bytes per 32 tokens) and one function traced by `mx.compile` unpacks them and selects (-inf
  where not allowed) in one fused elementwise kernel, then the argmax: two kernels;
- `masked_logits`: the logits with every token the mask does not allow at -inf, fused the same
  way, for rows whose sampler, penalties or processors choose from them.

Contract: `masked_logits(logits, words)` equals `apply_token_mask(logits, words)` element for
element (same dtype, same -inf), so `masked_argmax` and any sampler choose exactly the tokens
they chose from it; `forced_tokens` names a token only when it is the single one the mask allows
below the logits' width, and so what the argmax of the masked logits is whatever they hold
(unless the model's own logit for it is -inf or NaN: there the plain operations' argmax could
name a token the mask does not allow, which the grammar would then refuse).
tests/test_masked_choice.py checks all this against `apply_token_mask`.

Shapes: `logits` (rows, width) of any float dtype; `words` a numpy uint32 array (rows,
mask_words) from `GrammarMatcher.allowed_words` / `allowed_words_of`. Tokens past the mask are
not allowed; mask bits past `width` are ignored (a model whose output layer is wider or narrower
than the tokenizer's vocabulary). `mx.compile` traces once per (rows, width, dtype); its cache is
per thread (the runner's thread keeps its traces across engines, `actors/runner_threads`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

_NEG_INF = float("-inf")
#: bit `b` of a mask word, for b in 0..31 (made on first use)
_BITS: Any = None


def forced_tokens(words: np.ndarray[Any, np.dtype[np.uint32]], width: int) -> list[int | None]:
    """Per row of `words` (shape (rows, mask_words)): the token its mask allows when it allows
    exactly one below `width`, else None. A few µs a row on the host."""
    found: list[int | None] = [None] * words.shape[0]
    nonzero = words != 0
    rows = np.flatnonzero(np.count_nonzero(nonzero, axis=-1) == 1)
    if rows.size == 0:
        return found
    index = nonzero[rows].argmax(axis=-1)  # the one non-zero word of each
    for row, i in zip(rows.tolist(), index.tolist(), strict=True):
        word = int(words[row, i])
        if word & (word - 1) == 0:  # one bit set
            token = 32 * i + word.bit_length() - 1
            found[row] = token if token < width else None
    return found


def greedy_choice(
    logits: Any, words: np.ndarray[Any, np.dtype[np.uint32]]
) -> tuple[Any, int | None]:
    """A greedy row's token under its mask (`logits` and `words` of one row): the token the mask
    forces when it allows one (no device work), else the fused masked argmax; shape (1,), lazy.
    Also the forced token, or None."""
    (forced,) = forced_tokens(words, logits.shape[-1])
    if forced is None:
        return masked_argmax(logits, words), None
    return mx.array([forced], dtype=mx.uint32), forced


def masked_argmax(logits: Any, words: np.ndarray[Any, np.dtype[np.uint32]]) -> Any:
    """Each row's argmax over the tokens its mask allows: shape (rows,), uint32, lazy."""
    return _masked_argmax(logits, *_device_words(words, logits.shape[-1]))


def masked_logits(logits: Any, words: np.ndarray[Any, np.dtype[np.uint32]]) -> Any:
    """`logits` (shape (rows, width)) with every token the mask does not allow at -inf; lazy."""
    return _masked_logits(logits, *_device_words(words, logits.shape[-1]))


def _device_words(words: np.ndarray[Any, np.dtype[np.uint32]], width: int) -> tuple[Any, Any]:
    """The mask words fitted to `width` (cut, or zero-padded: tokens past the mask are not
    allowed) as an MLX array, and the bit table."""
    global _BITS
    if _BITS is None:
        _BITS = mx.array(np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32)))
    need = -(-width // 32)
    have = words.shape[-1]
    if have > need:
        words = words[:, :need]
    elif have < need:
        words = np.pad(words, ((0, 0), (0, need - have)))
    return mx.array(words), _BITS


def _select(logits: Any, words: Any, bits: Any) -> Any:
    """Traced: unpack and select in elementwise operations that `mx.compile` fuses into one
    kernel. With a width that is a multiple of 32 the logits are viewed as (rows, words, 32),
    so no reshape separates the unpacking from the `where`."""
    rows, width = logits.shape
    allowed = (words[:, :, None] & bits) != 0
    if width % 32 == 0:
        grouped = logits.reshape(rows, width // 32, 32)
        return mx.where(allowed, grouped, _NEG_INF).reshape(rows, width)
    return mx.where(allowed.reshape(rows, -1)[:, :width], logits, _NEG_INF)


def _select_argmax(logits: Any, words: Any, bits: Any) -> Any:
    return mx.argmax(_select(logits, words, bits), axis=-1)


_masked_logits = mx.compile(_select)
_masked_argmax = mx.compile(_select_argmax)
