"""Building a sequence's live prompt cache, with `max_kv_size` applied. Runner thread only.

`mlx_lm.models.cache.make_prompt_cache(model, max_kv_size)` honours `max_kv_size` only for models
without a `make_cache` method of their own. In mlx-lm 0.32 most architectures have one (llama,
qwen, gemma, mistral, phi3, ... about fifty: every model with a sliding-window or hybrid variant),
and for them the bound is silently ignored: the cache grows with the sequence. `make_cache`
applies the bound itself: every plain `KVCache` layer the model asks for (also inside a
`CacheList`) becomes a `RotatingKVCache(max_size=max_kv_size, keep=4)`, which is what mlx-lm builds
for models without `make_cache`. Layers the model made otherwise (its own sliding windows,
recurrent state, chunked caches) are the model's semantics and stay as they are.

On the batched route a bounded window keeps no leading positions (`keep=0`: `make_cache(...,
keep=0)`, `without_kept_tokens` for a restored cache): mlx-lm's batch window
(`BatchRotatingKVCache`) has no kept positions, so a sequence whose window kept some would attend
differently once merged into a batch than alone, and its output would depend on its companions.
A window without kept positions also attends to the same positions however its prompt is cut
into chunks (`chunking_exact_limit`), so there a sequence's output depends neither on its
companions nor on the pacer's chunk sizes. Measured on the tiny model with `max_kv_size` 40 and
a 41-token prompt beside another request: with kept positions the batch's first token already
differed from the request alone; without, every token equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

__all__ = ["KEEP_TOKENS", "chunking_exact_limit", "make_cache", "without_kept_tokens"]

#: Leading positions a bounded cache never drops (the attention sink), as mlx-lm keeps.
KEEP_TOKENS = 4


def make_cache(model: Any, max_kv_size: int | None = None, keep: int = KEEP_TOKENS) -> list[Any]:
    """A fresh prompt cache for `model` (one entry per layer).

    Without `max_kv_size`, exactly what `make_prompt_cache(model)` builds. With it, each plain
    `KVCache` layer is replaced by `RotatingKVCache(max_size=max_kv_size, keep=keep)`, so the
    key/value memory of a sequence stays bounded at `max_kv_size` positions per layer (`keep`:
    the batched route's 0, see the module docstring).
    """
    cache = make_prompt_cache(model)
    if max_kv_size is None:
        return cache
    return [_bounded(c, max_kv_size, keep) for c in cache]


def _bounded(layer: Any, max_kv_size: int, keep: int) -> Any:
    if type(layer) is KVCache:
        return RotatingKVCache(max_size=max_kv_size, keep=keep)
    if type(layer) is CacheList:
        return CacheList(*(_bounded(child, max_kv_size, keep) for child in layer.caches))
    return layer


def without_kept_tokens(cache: list[Any]) -> list[Any]:
    """`cache` (in place) with its bounded windows keeping no leading positions, where none has
    dropped a position yet (then the kept positions have not counted: the window is as if built
    with `keep=0`); a window that has is left as it is."""

    def visit(layer: Any) -> None:
        if isinstance(layer, RotatingKVCache):
            if layer.keep and layer.offset <= layer.max_size:
                layer.keep = 0
        elif isinstance(layer, CacheList):
            for child in layer.caches:
                visit(child)

    for layer in cache:
        visit(layer)
    return cache


def chunking_exact_limit(cache: Sequence[Any]) -> int | None:
    """The longest prompt whose prefill computes the same thing however it is chunked, or None
    when every length does (up to floating-point rounding, as for any change of chunk sizes).

    Only rotating layers that keep leading tokens (`keep > 0`, what `max_kv_size` builds) are
    sensitive: once such a layer is full, mlx-lm's multi-token update lets later queries of a
    chunk lose sight of the kept tokens, which one-chunk and several-chunk prefills do at
    different places. Up to `max_size` tokens nothing is dropped and the chunking does not
    matter. Rotating layers without kept tokens (a model's own sliding windows) show each query
    exactly the last `max_size` positions whatever the chunking, so they set no limit.
    """
    sizes: list[int] = []

    def visit(layer: Any) -> None:
        if isinstance(layer, RotatingKVCache):
            if layer.keep > 0:
                sizes.append(int(layer.max_size))
        elif isinstance(layer, CacheList):
            for child in layer.caches:
                visit(child)

    for layer in cache:
        visit(layer)
    return min(sizes) if sizes else None
