"""Short multi-token forward passes whose attention sees a key length that rarely changes.
Runner thread only.

On MLX's CUDA backend a multi-token attention goes to cuDNN, which builds a graph for every new
(query length, key length) pair (50-150 ms each on the H200, `mlx_cuda.py`). Decoding one token
is spared (MLX passes cuDNN the cache's whole buffer with a padding mask), but a speculative
verification of K+1 tokens, at a key length one step longer each time, would build a graph every
step. `padded_forward` runs such a pass with the attention over the cache's whole buffer (whose
size changes only when the cache grows, by 256 positions) and an additive mask that hides the
positions past each query: the same attention, and one graph per buffer size.

The mask is additive (0 / -inf) for attention that adds it to its scores, and boolean (True: seen)
for the multi-head latent attention (MLA) of DeepSeek-V3 and its kin (layers with a
`kv_a_proj_with_mqa`), which takes its mask as the condition of an `mx.where`: an additive mask
there would hide exactly the positions it should show (`takes_boolean_mask`).

It wraps each layer of a plain `KVCache` or a `BatchKVCache` in a view for that one call; any
other cache (rotating, quantized, recurrent) runs the ordinary pass.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


def padded_attention_default() -> bool:
    """On by default where it pays: MLX's CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def padded_forward(model: Any, tokens: Any, cache: list[Any]) -> Any:
    """`model(tokens, cache=cache)` (tokens of shape (B, N)), with every attention over the
    cache's whole buffer (see the module). The cache is updated exactly as by the plain call."""
    return model(tokens, cache=padded_layers(model, cache, int(tokens.shape[1])))


def padded_layers(model: Any, cache: list[Any], n: int) -> list[Any]:
    """What `model` takes as its cache for a pass of `n` tokens on `cache` with every attention
    over the cache's whole buffer: a view of each layer for that one pass, or `cache` itself
    where the pass cannot be padded (one token, or another kind of cache)."""
    views = _views(cache, n, boolean=takes_boolean_mask(model)) if n > 1 else None
    return cache if views is None else views


def forward_run(model: Any, tokens: list[int], cache: list[Any], pad_to: int | None) -> Any:
    """Feed `tokens` (one sequence's) to `model` on `cache` in one pass; return the logits after
    the last of them (shape (1, vocab)). With `pad_to`, the pass is padded to that many tokens
    (copies of the last) with attention over the cache's whole buffer (`padded_forward`), so that
    its shape recurs, and the padding is trimmed off the cache: the same logits and cache."""
    n = len(tokens)
    if pad_to is None:
        return model(mx.array(tokens, dtype=mx.uint32)[None], cache=cache)[:, -1, :]
    assert 0 < n <= pad_to
    padded = mx.array(tokens + [tokens[-1]] * (pad_to - n), dtype=mx.uint32)[None]
    logits = padded_forward(model, padded, cache)[:, n - 1, :]
    if n < pad_to:
        for layer in cache:
            layer.trim(pad_to - n)
    return logits


def takes_boolean_mask(model: Any) -> bool:
    """Whether `model` (an mlx-lm model or its trunk) needs a boolean attention mask: its first
    layer's attention is MLA (see the module)."""
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    return hasattr(getattr(layers[0], "self_attn", None), "kv_a_proj_with_mqa")


def _write_index(layer: Any) -> int:
    return int(layer._idx) if type(layer) is BatchKVCache else int(layer.offset)


def _views(cache: list[Any], n: int, *, boolean: bool = False) -> list[Any] | None:
    if not cache or any(type(c) not in (KVCache, BatchKVCache) or c.keys is None for c in cache):
        return None
    start = _write_index(cache[0])
    if any(_write_index(c) != start for c in cache):
        return None
    for layer in cache:
        _reserve(layer, start + n)
    width = int(cache[0].keys.shape[2])
    if any(int(c.keys.shape[2]) != width for c in cache):
        return None
    columns = mx.arange(width)[None, :]
    rows = mx.arange(start, start + n)[:, None]
    visible = rows >= columns  # (n, width): causal, and nothing past the last query
    first = cache[0]
    if type(first) is BatchKVCache:
        visible = visible[None, None] & (first.left_padding[:, None, None, None] <= columns)
    if boolean:
        return [_PaddedView(layer, width, visible) for layer in cache]
    dtype = first.keys.dtype
    mask = mx.where(visible, mx.array(0.0, dtype=dtype), mx.array(float("-inf"), dtype=dtype))
    return [_PaddedView(layer, width, mask) for layer in cache]


def _reserve(layer: Any, needed: int) -> None:
    """Grow the layer's buffers (in its own steps) so the call will not grow them."""
    have = int(layer.keys.shape[2])
    if needed <= have:
        return
    step = int(layer.step)
    grow = -(-(needed - have) // step) * step
    b, h, _, dk = layer.keys.shape
    dv = layer.values.shape[3]
    layer.keys = mx.concatenate([layer.keys, mx.zeros((b, h, grow, dk), layer.keys.dtype)], 2)
    layer.values = mx.concatenate([layer.values, mx.zeros((b, h, grow, dv), layer.values.dtype)], 2)


class _PaddedView:
    """One layer's cache for one call: RoPE offsets and writes as the layer's own; the attention
    gets the whole buffer and `mask`."""

    def __init__(self, layer: Any, width: int, mask: Any) -> None:
        self._layer = layer
        self._width = width
        self._mask = mask

    @property
    def offset(self) -> Any:
        return self._layer.offset

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        self._layer.update_and_fetch(keys, values)
        layer = self._layer
        return layer.keys[..., : self._width, :], layer.values[..., : self._width, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: Any = None) -> Any:
        return self._mask

    def attend(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        """The attention over the buffer (reached through `decode_attention`'s dispatcher where
        it is installed), with the queries row-contiguous: MLX's CUDA backend keys its cuDNN
        graphs by the queries' strides too, and the layout a model's RoPE leaves them in is its
        own, so the graph `prefill_shapes.warm_graphs` builds (row-contiguous queries) is the
        one every padded pass of that shape finds. A copy where they are not already so."""
        return mx.fast.scaled_dot_product_attention(
            mx.contiguous(queries), keys, values, scale=scale, mask=mask
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)
