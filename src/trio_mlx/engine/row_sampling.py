"""Sampled tokens for many rows at once: each row's temperature, top-k, top-p and min-p, then a draw
by the inverse of its cumulative distribution at a uniform number the host computes. Runs on the
runner thread only; used by `sampling.TokenSelector` (one sequence: one row) and
`batch_choice.BatchChoice` (the sampled rows of a decode batch, in one pass).

Why: drawn with MLX's own PRNG (a key split per step, `mx.random.categorical`) a sampled row put
~38 operations into a step's graph, its own split, random bits and cumulative sum among them, so
a batch of 64 sampled rows added ~2,400 operations to a decode step whose whole 8B forward pass is
~1,000; on a GPU, where the host's building and dispatching of the graph is what a step costs,
that is a step's time again. Here the host computes each row's uniform number and the device
takes every row's filters and draw in one set of operations over the rows' logits (~20 whatever
their count): `sample` over (rows, vocab).

The draw: the row's uniform number `draw(seed, n)` depends only on its request's seed and on how
many tokens it drew before (`n`: splitmix64 of the two, its top 23 bits and a half: strictly
inside (0, 1)), never on its companions; its token is the first whose cumulative probability
exceeds that number times the total (the inverse transform: each token with its softmax
probability, up to float32's rounding of the sums; tests check the frequencies). One row or
many, the same operations give each row the same token (on the CPU backend exactly; tests), so a
seeded request draws the same tokens alone, in a batch beside any companions, and on either
route.

Filters, as OpenAI's and mlx-lm's: temperature divides the logits; top-k keeps the k largest (0:
all); top-p keeps the smallest set of most probable tokens whose mass reaches p (the top token
always; 1.0: all); min-p drops tokens below p times the top probability (0: none). A filter a row
does not use leaves its logits exactly as they are, so a row's result does not depend on which
filters its companions use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


def draw(seed: int, n: int) -> float:
    """The uniform number of a row's `n`-th draw (from 0) under `seed` (any integer; taken modulo
    2**64): an odd multiple of 2**-24 in (0, 1), so neither end is reached."""
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 41) + 0.5) / float(1 << 23)


class RowParams:
    """The rows' filter parameters as (rows, 1) arrays, made once for a set of rows (a batch
    rebuilds them when its rows change); a filter no row uses is None (skipped)."""

    def __init__(
        self,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
    ) -> None:
        self.temperature = _column(temperature, mx.float32)
        self.top_k = _column(top_k, mx.int32) if any(k > 0 for k in top_k) else None
        self.top_p = _column(top_p, mx.float32) if any(p < 1.0 for p in top_p) else None
        self.min_p = _column(min_p, mx.float32) if any(p > 0.0 for p in min_p) else None


def _column(values: Sequence[float], dtype: Any) -> Any:
    return mx.array(list(values), dtype=dtype)[:, None]


def filtered(logits: Any, params: RowParams) -> Any:
    """The rows' logits (float32, shape (n, vocab)) after temperature, top-k, top-p and min-p,
    the dropped tokens at -inf. `params` has a row for each row of `logits`, or one for all."""
    logits = logits.astype(mx.float32) / params.temperature
    width = logits.shape[-1]
    if params.top_k is not None:
        # the k-th largest value of each row (k of 0, or past the width: the smallest, so none
        # is below it)
        k = mx.where((params.top_k > 0) & (params.top_k < width), params.top_k, width)
        ordered = mx.sort(logits, axis=-1)
        index = mx.broadcast_to(width - k, (logits.shape[0], 1))
        kth = mx.take_along_axis(ordered, index, axis=-1)
        logits = mx.where(logits < kth, _NEG_INF, logits)
    if params.top_p is not None:
        probs = mx.softmax(logits, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        # a token stays if the mass strictly before it is below p (the top token always stays);
        # a row at 1.0 keeps every token (rounding could make its mass reach 1.0 early)
        keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs < params.top_p) | (
            params.top_p >= 1.0
        )
        keep = mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)
        logits = mx.where(keep, logits, _NEG_INF)
    if params.min_p is not None:
        probs = mx.softmax(logits, axis=-1)
        floor = params.min_p * mx.max(probs, axis=-1, keepdims=True)
        logits = mx.where(probs < floor, _NEG_INF, logits)
    return logits


def sample(logits: Any, params: RowParams, uniforms: Sequence[float]) -> Any:
    """Each row's token (uint32, shape (rows,), lazy) from its logits (shape (rows, vocab), bias
    and penalties already added), its filters and its uniform number (`draw`)."""
    probs = mx.softmax(filtered(logits, params), axis=-1)
    cumulative = mx.cumsum(probs, axis=-1)
    target = mx.array(list(uniforms), dtype=mx.float32)[:, None] * cumulative[:, -1:]
    # the first token whose cumulative probability exceeds the target: as many as do not
    # (a token of probability 0 never adds to the count's edge, so it is never chosen)
    token = mx.sum(cumulative <= target, axis=-1)
    return mx.minimum(token, logits.shape[-1] - 1).astype(mx.uint32)
