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
- from its second chunk on, runs them with the attention over a buffer reserved once for the
  whole prompt (`reserved_width`: its length rounded up to `WIDTH_BLOCK` positions) and a mask
  that hides what each query must not see (`padded_attention.padded_forward`), so every chunk
  of a prompt has one key length, shared by every prompt of the same width bucket.
A prompt then costs cuDNN at most one graph per rung and width bucket the first time they are
seen, and none after (the same bench: 18 ms a 128-token chunk the first time too). The first
chunk runs on the fresh cache as before (its key length is its own size: a rung).

The attention over the reserved buffer computes the masked positions too: on the same bench a
512-token chunk took 24.5 ms padded against 20.9 ms plain once warm; at 128 and 256 tokens the
two are equal within noise. The buffer is what the cache would have grown to anyway (rounded up
by less than `WIDTH_BLOCK` positions more).

Where: `padded_prefill_default()` (MLX's CUDA backend) and plans with blocks (`PrefillPlan.block
> 1`: a cache that can be cut back after a padded chunk). Other caches (rotating, quantized,
recurrent layers) run the plain pass (`padded_forward` leaves them be).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from trio_mlx.engine.padded_attention import padded_attention_default

#: A prefilling sequence's cache is reserved to its prompt's length (plus a block) rounded up to
#: this many positions: the key length of its chunks.
WIDTH_BLOCK = 1024


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


def reserved_width(prompt_tokens: int, block: int) -> int:
    """The key length of a prompt's chunks: its length plus a block (the last chunk's padding),
    rounded up to `WIDTH_BLOCK`."""
    return -(-(prompt_tokens + block) // WIDTH_BLOCK) * WIDTH_BLOCK


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
