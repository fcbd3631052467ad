"""Tokens at positions other than their place in storage: a KV cache whose stored tokens need
not be contiguous in position (`PositionedKVCache`), and a RoPE that rotates each token of a chunk
by its own position (`PositionedRoPE`, while `chunk_positions` is active). SpecPrefill's kept
tokens (`specprefill`) live in such caches, on both routes; the batched route's cache layout
(`batch_layout`, `batch_mask`, `batch_jump`) reads them. The decode step that carries prefill
chunks (`mixed_step`) rotates its rows' and chunks' tokens by `PositionedRoPE` too. Runner thread
only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class PositionedKVCache(KVCache):
    """A KV cache whose stored tokens need not be contiguous in position: `offset` (what the
    model's RoPE and masks read) is the stored length plus `shift`, set before each run of
    consecutive positions. Storage, slicing and trimming use the stored length."""

    def __init__(self) -> None:
        self.shift = 0
        self.stored = 0
        super().__init__()

    @property
    def offset(self) -> int:
        return self.stored + self.shift

    @offset.setter
    def offset(self, value: int) -> None:
        self.stored = value - self.shift

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        shift, self.shift = self.shift, 0  # the base class indexes storage by `offset`
        try:
            return super().update_and_fetch(keys, values)
        finally:
            self.shift = shift

    def keys_and_values(self) -> Any:
        keys: Any = self.keys
        values: Any = self.values
        return keys[..., : self.stored, :], values[..., : self.stored, :]

    def size(self) -> int:
        return self.stored

    @property
    def state(self) -> Any:
        return self.keys_and_values() if self.keys is not None else (None, None)

    @state.setter
    def state(self, v: Any) -> None:
        raise NotImplementedError("a SpecPrefill cache is never restored")

    def trim(self, n: int) -> int:
        n = min(self.stored, n)
        self.stored -= n
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        shift, self.shift = self.shift, 0
        try:
            return super().make_mask(*args, **kwargs)
        finally:
            self.shift = shift


def positioned_cache(keys: Any, values: Any, stored: int, shift: int) -> PositionedKVCache:
    """A `PositionedKVCache` holding `stored` positions of `keys` / `values` (axis 2), its next
    token at position `stored + shift` (a SpecPrefill row's cache copied out of a batch)."""
    cache = PositionedKVCache()
    cache.keys, cache.values = keys, values
    cache.stored, cache.shift = stored, shift
    return cache


def stored_length(layer: Any) -> int:
    """The positions a plain or positioned KV cache layer holds (its write index)."""
    return int(layer.stored) if isinstance(layer, PositionedKVCache) else int(layer.offset)


_positions = threading.local()


class PositionedRoPE:
    """A model's RoPE module that, while `_positions.value` (an int32 array of the chunk's
    positions) is set on this thread, rotates token i by position `value[i]` rather than by
    `offset + i`: the chunk's tokens become a batch of one-token rows, each with its own offset,
    through the same module (its frequencies and scaling kept). Otherwise a pass-through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, x: Any, offset: Any = 0) -> Any:
        positions = getattr(_positions, "value", None)
        if positions is None or x.shape[0] != 1 or x.shape[-2] != positions.shape[0]:
            return self.inner(x, offset=offset)
        rows = x.swapaxes(0, 2)  # (1, H, L, D) -> (L, H, 1, D)
        return self.inner(rows, offset=positions).swapaxes(0, 2)


def install_positioned_rope(model: Any) -> bool:
    """Wrap every `rope` of `model`'s modules in a `PositionedRoPE` (once; an instance attribute
    shadows the module's entry, so parameters and weights are untouched). False if none has one."""
    import mlx.nn as nn

    found = False
    for module in model.modules():
        inner = module.get("rope") if isinstance(module, dict) else None
        current = getattr(module, "rope", None)
        if isinstance(current, PositionedRoPE):
            found = True
        elif isinstance(inner, nn.Module):  # type: ignore[attr-defined]
            object.__setattr__(module, "rope", PositionedRoPE(inner))
            found = True
    return found


def chunk_positions(positions: list[int]) -> contextlib.AbstractContextManager[None]:
    """While inside, every `PositionedRoPE` on this thread rotates a chunk of `len(positions)`
    tokens by `positions` (token i at `positions[i]`)."""
    return token_positions(mx.array(positions, dtype=mx.int32))


@contextlib.contextmanager
def token_positions(positions: Any) -> Iterator[None]:
    """`chunk_positions` for positions already in an int32 array (built on the device)."""
    _positions.value = positions
    try:
        yield
    finally:
        _positions.value = None
