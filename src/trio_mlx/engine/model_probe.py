"""What the runner measures of a loaded model before it serves: one sequence's KV cache bytes per
token, whether its cache can be batched, and a first prefill rate for the pacer. Runs on the
runner thread (it makes MLX arrays)."""

from __future__ import annotations

import logging
import time
from typing import Any

from trio_mlx.engine.batch_layout import batchable
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.engine.scheduling import PrefillPacer

log = logging.getLogger(__name__)


#: Prompt tokens of the timed forward pass at load that gives the pacer its first prefill rate.
CALIBRATION_TOKENS = 8

#: On a GPU a second pass of this many times as many tokens is timed too (`probe_cache`).
GPU_CALIBRATION_FACTOR = 8


def _prefill_pass(model: Any, tokens: int) -> float:
    """Seconds of one prefill pass of `tokens` tokens on a fresh cache (evaluated as a prefill
    chunk is: the cache, not the logits)."""
    import mlx.core as mx

    began = time.perf_counter()
    timed = make_cache(model)
    model(mx.zeros((1, tokens), dtype=mx.uint32), cache=timed)
    mx.eval([c.state for c in timed])
    return time.perf_counter() - began


def probe_cache(model: Any, max_kv_size: int | None, pacer: PrefillPacer) -> tuple[int, bool]:
    """KV cache bytes per token of one sequence (one position through a fresh cache), and
    whether the cache can be merged into a batch. (0, False) when the probe fails. Times a
    short prefill pass for `pacer`'s first estimate, so that even the first prompt's chunks are
    sized for this device."""
    import mlx.core as mx

    try:
        cache = make_cache(model, max_kv_size)
        mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=cache))
        tokens = max(CALIBRATION_TOKENS, pacer.block)
        if mx.default_device() == mx.gpu:
            # Two sizes, each timed once warm, so that the pacer can fit a GPU pass's fixed
            # cost from the start (`scheduling`), and the first requests build fewer kernels.
            for n in (tokens, GPU_CALIBRATION_FACTOR * tokens):
                _prefill_pass(model, n)
                pacer.observe_chunk(n, _prefill_pass(model, n))
        else:
            pacer.observe_chunk(tokens, _prefill_pass(model, tokens))
        per_token = 0
        for layer in cache:
            for name in ("keys", "values"):
                array = getattr(layer, name, None)
                if array is not None and hasattr(array, "shape") and len(array.shape) == 4:
                    per_token += int(array.nbytes) // int(array.shape[2])
        return per_token, batchable(cache)
    except Exception:
        log.exception("probing the KV cache failed")
        return 0, False


def attention_shape(model: Any) -> tuple[int, int, int, Any] | None:
    """Query heads, key/value heads, head size and activation dtype of an mlx-lm model of the
    modules the attention dispatcher reaches (`compiled_step.COMPILABLE_MODULES`: their `args`
    and `model.embed_tokens`), or None for any other model: what a warm-up at load needs to run
    an attention of the model's own shape."""
    from trio_mlx.engine.compiled_step import COMPILABLE_MODULES

    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if type(model).__module__ not in COMPILABLE_MODULES or not heads:
        return None
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    dims = getattr(args, "head_dim", None) or getattr(args, "hidden_size", 0) // heads
    embed = model.model.embed_tokens
    dtype = getattr(embed, "scales", embed.weight).dtype  # a quantized one: its scales'
    return int(heads), int(kv_heads), int(dims), dtype
