"""One request's position in its grammar, and the token masks it gives. Runner thread only.

A mask is computed on the CPU (llguidance writes a bitmask, one bit a token, into a numpy array)
and applied to the logits on the device. The engine applies it with `masked_choice` (the packed
words unpacked and applied in one fused kernel; a mask that allows a single token needs no
device work for a greedy choice). `token_mask` and `apply_token_mask` here spell the same mask
out in plain MLX operations: on a GPU the 32-bit words go over as one small array (6 KiB for a
49k vocabulary) and are unpacked there (shift, and); on MLX's CPU backend numpy unpacks them;
either way an MLX `where` applies them. They are the reference `masked_choice` is tested
against, and the "before" of `bench.constrained`.

Vocabulary sizes: the mask covers the tokenizer's vocabulary; a model whose output layer is
wider (embedding rows padded past the tokenizer's ids) has the extra entries masked out, and one
whose output layer is narrower has the mask cut to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_SHIFTS = np.arange(32, dtype=np.uint32)
_EXECUTOR: Any = None


class GrammarViolation(ValueError):
    """The grammar refused a token or can no longer continue (the request fails with this)."""


class GrammarMatcher:
    """Where one generation stands in its grammar. Made by `CompiledGrammar.matcher()`; owned by
    one sequence on the runner thread, dropped with it (an abort frees it)."""

    __slots__ = ("_ll", "mask_words")

    def __init__(self, ll_matcher: Any, mask_words: int) -> None:
        self._ll = ll_matcher
        self.mask_words = mask_words

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the generation ends here."""
        return bool(self._ll.is_stopped()) and not self._ll.is_error()

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete match (an EOS would be allowed)."""
        return bool(self._ll.is_accepting())

    def allowed_words(self) -> np.ndarray[Any, np.dtype[np.uint32]]:
        """The next token's mask: shape (mask_words,), bit `t % 32` of word `t // 32` set when
        token `t` is allowed. `GrammarViolation` when the grammar has failed."""
        words = np.empty((1, self.mask_words), dtype=np.int32)
        self._ll.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        self._check()
        row: np.ndarray[Any, np.dtype[np.uint32]] = words[0].view(np.uint32)
        return row

    def consume(self, token: int) -> None:
        """Advance past `token` (the one chosen under the last mask)."""
        if not self._ll.consume_token(token):
            raise GrammarViolation(
                f"the output format's grammar refused token {token}: {self._ll.get_error()}"
            )

    def _check(self) -> None:
        if self._ll.is_error():
            raise GrammarViolation(f"the output format's grammar failed: {self._ll.get_error()}")


def allowed_words_of(matchers: Sequence[GrammarMatcher]) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """Every matcher's next mask, shape (len(matchers), mask_words); computed in parallel on
    llguidance's own threads when there are several."""
    if len(matchers) == 1:
        return matchers[0].allowed_words()[None]
    global _EXECUTOR
    import llguidance

    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    n = matchers[0].mask_words
    words = np.empty((len(matchers), n), dtype=np.int32)
    _EXECUTOR.unsafe_compute_mask_ptr(
        [(m._ll, i) for i, m in enumerate(matchers)], words.ctypes.data, n * 4, len(matchers)
    )
    for m in matchers:
        m._check()
    return words.view(np.uint32)


def token_mask(words: np.ndarray[Any, np.dtype[np.uint32]], width: int) -> Any:
    """The allowed tokens as a boolean MLX array of shape (rows, width), unpacked on the device
    from `words` (shape (rows, mask_words)); tokens past the mask are not allowed."""
    import mlx.core as mx

    rows = words.shape[0]
    if mx.default_device() == mx.cpu:
        # On the CPU backend numpy's unpacking is cheaper than four MLX operations (~240 µs
        # against ~300 µs for 49k tokens on a loaded 2-core machine), and nothing is copied
        # to another device.
        unpacked = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
        allowed = mx.array(unpacked.astype(np.bool_))
    else:
        bits = (mx.array(words)[..., None] >> mx.array(_SHIFTS)) & 1
        allowed = bits.reshape(rows, -1).astype(mx.bool_)
    have = allowed.shape[-1]
    if have > width:
        return allowed[:, :width]
    if have < width:
        return mx.concatenate([allowed, mx.zeros((rows, width - have), dtype=mx.bool_)], axis=1)
    return allowed


def apply_token_mask(logits: Any, words: np.ndarray[Any, np.dtype[np.uint32]]) -> Any:
    """`logits` (shape (rows, width)) with every token the mask does not allow set to -inf."""
    import mlx.core as mx

    allowed = token_mask(words, logits.shape[-1])
    return mx.where(allowed, logits, mx.array(float("-inf"), dtype=logits.dtype))
