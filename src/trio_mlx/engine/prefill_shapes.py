"""Prefill chunks whose attention shapes recur, for the batched route on MLX's CUDA backend.
Runner thread only.

Why: a multi-token attention on MLX's CUDA backend goes to cuDNN, which builds a graph for every
new (query length, key length) pair, 50-150 ms each (`mlx_cuda.py`). A long prompt admitted to a
busy batch is prefilled a chunk per step (`batch_join.prefill`), every chunk at a new key length:
on the H200's 8B bf16 shape (`python -m bench.prefill_chunks`, 16 rows decoding, an 8,192-token
prompt) a 128-token chunk took 88 ms the first time its shapes were seen against 18 ms once they
had been, so the running streams' inter-token gap grew ~6x while the prompt was admitted.

What: a sequence that prefills in chunks
- cuts a chunk that leaves some of the prompt from a short ladder of sizes (`chunk_ladder`: the
  plan's block times 1, 2, 4, ... up to the plan's step; `pass_size` takes the largest rung the
  budget allows); a rest that fits the budget goes whole, in whole blocks as before (a lone
  prompt is not cut into more passes than it was: on the H200 a pass has a fixed cost);
- from its second chunk on, runs each with the attention over its cache's buffer grown to a
  width bucket (`key_width`: the keys the chunk needs rounded up to a power of two from 1,024,
  then to a multiple of 8,192) and a mask that hides what each query must not see
  (`padded_attention.padded_forward`), so a prompt's chunks share a few key lengths, and every
  prompt shares them.
A prompt then costs cuDNN at most one graph per rung and width bucket the first time they are
seen, and none after (the same bench, where the whole 8,192-token prompt had one width: 18 ms a
128-token chunk the first time too). The first chunk runs on the fresh cache as before (its key
length is its own size). Past `PADDED_UP_TO` keys the chunks run plain: a graph's 50-150 ms is
small beside a chunk's attention over that many keys, and a padded chunk would compute up to
8,191 masked keys and hold a (tokens x width) mask.

The attention over the bucket computes the masked positions too: on the same bench a 512-token
chunk took 24.5 ms padded over the whole prompt's 8,192 positions against 20.9 ms plain once
warm; at 128 and 256 tokens the two are equal within noise. The buffer is what the cache grows
to anyway, rounded up to its bucket.

Where: `padded_prefill_default()` (MLX's CUDA backend) and plans with blocks (`PrefillPlan.block
> 1`: a cache that can be cut back after a padded chunk), on a model whose padded chunk gives the
plain chunk's logits (`padded_prefill_agrees`, checked once when the batch starts: a model that
builds its attention mask itself, not through its cache's `make_mask`, would attend to the
bucket's padding). Other caches (rotating, quantized, recurrent layers) run the plain pass
(`padded_forward` leaves them be).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from trio_mlx.engine.padded_attention import padded_attention_default

#: The smallest width bucket; buckets double up to `LINEAR_WIDTHS_FROM`, then grow by it.
FIRST_WIDTH = 1024
LINEAR_WIDTHS_FROM = 8192

#: Chunks whose keys would pass this many positions run plain (see the module docstring).
PADDED_UP_TO = 32768

#: `warm_graphs` stops once it has spent this many seconds.
WARM_SECONDS = 20.0

#: `padded_prefill_agrees`: the largest difference of the last logits, relative to their largest
#: magnitude, that counts as rounding (bf16 attention over the bucket sums in another order).
AGREEMENT = 0.02


def padded_prefill_default() -> bool:
    """On where cuDNN builds a graph per attention shape: MLX's CUDA backend."""
    return padded_attention_default()


def chunk_ladder(block: int, step: int) -> tuple[int, ...]:
    """The chunk sizes: `block` times 1, 2, 4, ... while at most `step` (at least `block`)."""
    sizes = [block]
    while sizes[-1] * 2 <= step:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def pass_size(wanted: int, block: int, step: int) -> int:
    """Prompt tokens for a chunk when `wanted` may go (the budget, the prompt's rest and the
    next store point already applied): the largest rung of the ladder at most `wanted`, or
    `wanted` itself when less than a block (the chunk is then padded to a block)."""
    if wanted < block:
        return wanted
    return max(size for size in chunk_ladder(block, step) if size <= wanted)


def key_width(needed: int) -> int:
    """The width bucket for a chunk after which the cache holds `needed` positions: a power of
    two from `FIRST_WIDTH` up to `LINEAR_WIDTHS_FROM`, then a multiple of it."""
    if needed <= LINEAR_WIDTHS_FROM:
        return max(FIRST_WIDTH, 1 << (needed - 1).bit_length())
    return -(-needed // LINEAR_WIDTHS_FROM) * LINEAR_WIDTHS_FROM


def reserve(cache: list[Any], width: int) -> bool:
    """Grow every layer's buffers to `width` positions (zeros past what they hold; a buffer
    already as large is left as it is). Only for a cache whose every layer is a plain `KVCache`
    holding something: returns False, and changes nothing, for any other."""
    if not cache or any(type(c) is not KVCache or c.keys is None for c in cache):
        return False
    for layer in cache:
        have = int(layer.keys.shape[2])
        if have >= width:
            continue
        b, h, _, dk = layer.keys.shape
        dv = layer.values.shape[3]
        grow = width - have
        layer.keys = mx.concatenate([layer.keys, mx.zeros((b, h, grow, dk), layer.keys.dtype)], 2)
        layer.values = mx.concatenate(
            [layer.values, mx.zeros((b, h, grow, dv), layer.values.dtype)], 2
        )
    return True


def padded_prefill_agrees(model: Any, block: int) -> bool:
    """Whether `model`'s padded chunk gives the plain chunk's logits: two chunks of `block`
    tokens prefilled plain, then again with the second over a width bucket. A model that builds
    its attention mask itself instead of asking its cache (`make_mask`) would attend to the
    bucket's padding: the engine then keeps its chunks plain. True where nothing would be padded
    (a cache other than plain `KVCache` layers). Runner thread; raises what the model raises."""
    from mlx_lm.models.cache import make_prompt_cache

    from trio_mlx.engine.padded_attention import padded_forward

    tokens = (mx.arange(2 * block, dtype=mx.uint32) % 100 + 10)[None]
    first, second = tokens[:, :block], tokens[:, block:]
    plain_cache, padded_cache = make_prompt_cache(model), make_prompt_cache(model)
    model(first, cache=plain_cache)
    model(first, cache=padded_cache)
    if not reserve(padded_cache, key_width(2 * block)):
        return True
    plain = model(second, cache=plain_cache)[:, -1, :].astype(mx.float32)
    padded = padded_forward(model, second, padded_cache)[:, -1, :].astype(mx.float32)
    difference = mx.max(mx.abs(plain - padded)) / mx.maximum(mx.max(mx.abs(plain)), 1e-6)
    return bool((difference <= AGREEMENT).item())


def warm_graphs(model: Any, block: int, step: int, seconds: float = WARM_SECONDS) -> int:
    """Run once, at start, an attention of every shape a prefill chunk can take (`model`'s heads
    and dtype; each rung of the ladder on a fresh cache, causal, its queries in either layout a
    first chunk gives them, and over each width bucket up to `PADDED_UP_TO` keys, with an
    additive mask, as `padded_forward` gives it), so that cuDNN builds their graphs before a
    request needs them; stop once `seconds` are spent. Returns how many attentions ran (0 for a
    model whose shape `model_probe.attention_shape` cannot read). cuDNN keys a graph by the
    strides of the queries, keys and mask as well as their shapes: each is laid out here as the
    passes lay it out.

    Why: on an H100 (8B bf16, 16 rows decoding, `bench.long_arrival`) a chunk at a shape new to
    the process took 65-135 ms where a known one took 15-22 ms, the running streams' slowest
    gaps while a long prompt was admitted; a process meets its rung and width pairs one by one,
    long prompt after long prompt."""
    from trio_mlx.engine.model_probe import attention_shape

    shape = attention_shape(model)
    if shape is None:
        return 0
    heads, kv_heads, dims, dtype = shape
    began = time.perf_counter()
    ran = 0
    # every width's keys made once, for all the rungs
    buckets = {
        w: mx.zeros((1, kv_heads, w, dims), dtype=dtype)
        for w in _bucket_widths()
        if w <= PADDED_UP_TO
    }
    mx.eval(list(buckets.values()))
    for rung in chunk_ladder(block, step):
        queries = mx.zeros((1, heads, rung, dims), dtype=dtype)
        # a first chunk: its keys the start of a fresh cache's buffer (mlx-lm's 256-position
        # steps), its queries as the model's RoPE leaves them (a (1, rung, heads, dims) array
        # transposed) or, in a mixed pass, row-contiguous (`mixed_step`)
        buffer = mx.zeros((1, kv_heads, -(-rung // KVCache.step) * KVCache.step, dims), dtype=dtype)
        fresh = buffer[..., :rung, :]
        as_roped = mx.zeros((1, rung, heads, dims), dtype=dtype).swapaxes(1, 2)
        passes: list[tuple[Any, Any, Any]] = [
            (as_roped, fresh, "causal"),
            (queries, fresh, "causal"),
        ]
        for width, keys in buckets.items():
            if width > rung:  # a padded chunk: row-contiguous queries (`_PaddedView.attend`)
                passes.append((queries, keys, mx.zeros((rung, width), dtype=dtype)))
        for chunk_queries, keys, mask in passes:
            if time.perf_counter() - began >= seconds:
                return ran
            out = mx.fast.scaled_dot_product_attention(
                chunk_queries, keys, keys, scale=dims**-0.5, mask=mask
            )
            mx.eval(out)
            ran += 1
    return ran


def _bucket_widths() -> list[int]:
    """Every width bucket (`key_width`) up to `PADDED_UP_TO`, in order."""
    widths = [FIRST_WIDTH]
    while widths[-1] < PADDED_UP_TO:
        widths.append(key_width(widths[-1] + 1))
    return widths
