"""Token selection from a step's logits: greedy, temperature and nucleus (top-p) sampling.

Each sequence owns its own PRNG key, split once per step, so a seeded request draws the same
tokens whatever other requests run beside it and across restarts.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from trio_mlx.types import SamplingParams

#: Takes the last position's logits, shape (1, vocab), returns the chosen token, shape (1,).
Sampler = Callable[[Any], Any]


def make_sampler(params: SamplingParams) -> Sampler:
    """The sampler for `params`: argmax at temperature 0, else a seeded categorical draw."""
    if params.temperature == 0.0:
        return _greedy
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    state = {"key": mx.random.key(seed)}
    inv_temp = 1.0 / params.temperature
    top_p = params.top_p

    def sample(logits: Any) -> Any:
        key, state["key"] = mx.random.split(state["key"])
        scaled = logits.astype(mx.float32) * inv_temp
        if top_p < 1.0:
            scaled = _apply_top_p(scaled, top_p)
        return mx.random.categorical(scaled, key=key)

    return sample


def _greedy(logits: Any) -> Any:
    return mx.argmax(logits, axis=-1)


def _apply_top_p(logits: Any, top_p: float) -> Any:
    """Mask (to -inf) every token outside the smallest set whose probability reaches `top_p`."""
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    # A token stays if the mass strictly before it is below top_p (so the top token always stays).
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    inverse = mx.argsort(order, axis=-1)
    keep = mx.take_along_axis(keep_sorted, inverse, axis=-1)
    return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))
