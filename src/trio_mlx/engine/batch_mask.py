"""The batch's attention mask when no row is padded. Runner thread only.

mlx-lm's `BatchKVCache.make_mask` always builds a boolean array mask (the causal mask and every
row's left padding), even for a one-token decode step of a batch whose rows all start at the same
position, where it masks nothing. On MLX's CUDA backend an array mask keeps the fused decode
attention kernel out (attention then runs as separate matrix products and a softmax), so a lone
row on the batched route decoded at 0.64-0.74x the serialized route's speed on the H200
(docs/benchmarks/README.md, "Compiled decode and fused projections").

`adopt` gives each layer's `BatchKVCache` one host-side fact more: `aligned`, True while no
row has left padding. Then its `make_mask(N)` is None for one token (every cached position is
visible to the row's query) and "causal" for several (the plain causal mask, what a lone row's
speculative verification needs); otherwise mlx-lm's array mask. (A lone row now decodes on a
cache of its own, `BatchDecoder.solo`, with no batch mask at all; this still spares the array
mask to rows of one length, and to a lone row where the traced batch step keeps it in the batch
cache.) The fact is kept by the
`BatchDecoder` from Python integers it already has, never by reading the padding back from the
device (which would wait for the step in flight):
- `aligned_after_merge`: the batch built from caches of equal lengths has no padding;
- `aligned_after_extend`: joining keeps it only when both sides are aligned at the same length;
- `aligned_after_filter`: a lone row is aligned (`filter` shifts the smallest padding away); the
  rows kept from an aligned batch stay aligned.

The mask a layer adopts (`AlignedMask`) refers to its layer weakly. A bound method there (the
layer's own `make_mask` bound to it in its `__dict__`) made every adopted layer a reference cycle:
its keys and values then outlived the batch until Python's cyclic collector happened to run (an
abandonment storm on the tiny model ended with 1-6 MB of batch caches alive after the prefix
cache and MLX's buffer cache were cleared; a batch of long rows of a large model holds gigabytes).
An adopted layer is freed by reference counting, as soon as the batch lets go of it.
"""

from __future__ import annotations

import weakref
from typing import Any

from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine.true_positions import PositionedKVCache


def aligned_make_mask(cache: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
    """`BatchKVCache.make_mask` for a cache that knows whether it is `aligned` (module doc)."""
    if getattr(cache, "aligned", False) and not return_array and kwargs.get("window_size") is None:
        return None if N == 1 else "causal"
    return BatchKVCache.make_mask(cache, N, return_array=return_array, **kwargs)


class AlignedMask:
    """A layer's `make_mask` once adopted: `aligned_make_mask` for that layer, which it holds by a
    weak reference only, so that the layer holding it is no reference cycle (module docstring)."""

    __slots__ = ("_layer",)

    def __init__(self, layer: Any) -> None:
        self._layer = weakref.ref(layer)

    def __call__(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        layer = self._layer()
        if layer is None:  # only its layer calls it, which is alive while it does
            raise ReferenceError("the cache layer of this mask is gone")
        return aligned_make_mask(layer, N, return_array, **kwargs)


def adopt(layers: list[Any], aligned: bool) -> None:
    """Give each plain `BatchKVCache` of a batch's layers the host-side fact `aligned` and the
    mask that reads it (instance attributes: the object stays mlx-lm's class, which other code
    checks with `type(...) is BatchKVCache`; the mask refers to its layer weakly, so the layer is
    freed by reference counting, `AlignedMask`); other caches are left alone."""
    for layer in layers:
        if type(layer) is BatchKVCache:
            setattr(layer, "aligned", aligned)  # noqa: B010 (mlx-lm's class declares no such field)
            if "make_mask" not in vars(layer):
                setattr(layer, "make_mask", AlignedMask(layer))  # noqa: B010


def is_aligned(layers: list[Any]) -> bool:
    """Whether the batch's caches are known to have no left padding."""
    return bool(layers) and all(
        getattr(layer, "aligned", False) for layer in layers if type(layer) is BatchKVCache
    )


def sequence_length(layers: list[Any]) -> int | None:
    """A sequence's cached positions, from its first plain `KVCache` layer or SpecPrefill
    `PositionedKVCache` one (what it stores, not its RoPE position; None: it has none)."""
    for layer in layers:
        if type(layer) is KVCache:
            return int(layer.offset)
        if type(layer) is PositionedKVCache:
            return layer.stored
    return None


def batch_length(layers: list[Any]) -> int | None:
    """The batch's cached positions, padding included (None: no plain batch cache layer)."""
    for layer in layers:
        if isinstance(layer, BatchKVCache):
            return int(layer._idx)
    return None


def aligned_after_merge(lengths: list[int | None]) -> bool:
    """Rows merged from caches of these lengths (mlx-lm pads each to the longest)."""
    return None not in lengths and len(set(lengths)) <= 1


def aligned_after_extend(batch: list[Any], joiners_length: int | None) -> bool:
    """The batch extended by an aligned group of rows of one length (`joiners_length`; None:
    the group is padded)."""
    length = batch_length(batch)
    return is_aligned(batch) and length is not None and joiners_length == length


def aligned_after_filter(batch: list[Any], rows_kept: int) -> bool:
    """The rows kept by `filter`: one row is always aligned; an aligned batch stays so."""
    return rows_kept == 1 or is_aligned(batch)
