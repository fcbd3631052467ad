"""What the GPU kernel tests (`test_quantized_gemv.py`, `test_row_product.py`) measure their
kernels by: errors against float32 arithmetic, per product and over a lean step's logits."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from tiny_model import build_in_memory


def relative_errors(exact: Any, *outputs: Any) -> list[float]:
    """Each output's largest absolute difference from `exact`, over `exact`'s largest value."""
    scale = mx.abs(exact).max().item()
    return [mx.abs(out.astype(mx.float32) - exact).max().item() / scale for out in outputs]


def dequantized_copy(quantized: Any, *, tied: bool = False) -> Any:
    """The tiny llama of `quantized` (4-bit, group size 64) in float32 with its quantized weights
    dequantized: the exact arithmetic that the 4-bit kernels round."""
    exact = build_in_memory("llama", tied=tied)
    weights = [
        (f"{name}.weight", mx.dequantize(m.weight, m.scales, m.biases, group_size=64, bits=4))
        for name, m in quantized.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    ]
    exact.load_weights([(n, w.astype(mx.float32)) for n, w in weights], strict=False)
    return exact


def logit_errors(exact: Any, model: Any, lean: Any, steps: int = 40) -> tuple[float, float]:
    """Greedy steps of `exact` (the reference, choosing each next token): the summed mean
    absolute difference of the model's own logits and of the lean step's from the reference's,
    (own, lean)."""
    caches = [make_prompt_cache(m) for m in (exact, model, model)]
    own_error = ours_error = 0.0
    token = mx.array([7])
    for _ in range(steps):
        reference = exact(token[None], cache=caches[0])[:, -1, :]
        own = model(token[None], cache=caches[1])[:, -1, :].astype(mx.float32)
        ours = lean.logits(token, caches[2]).astype(mx.float32)
        own_error += mx.abs(own - reference).mean().item()
        ours_error += mx.abs(ours - reference).mean().item()
        token = mx.argmax(reference, axis=-1)
    return own_error, ours_error
