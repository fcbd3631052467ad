"""Snapshots of a prompt cache: copy its state out, later restore it (whole or trimmed) into a fresh
live cache. Runs on the runner thread only (it creates and evaluates MLX arrays).

Why this is exact:
- Caches write in place: `self.keys[..., a:b, :] = x` rebinds the *array object* `self.keys`, so
  anything else holding that same Python object would see the write. A snapshot therefore never
  shares an array object with a live cache, in either direction: it holds copies or new array
  objects (`copy.copy`, which shares the buffer), and `restore` hands each cache new objects too.
  Buffers may be shared; MLX writes in place into a buffer only when nothing else references
  it, and copies otherwise. So decoding into the original or a restored cache never changes the
  snapshot, and two caches restored from one snapshot are independent.
- Only cache classes whose whole state is known are accepted, checked by exact class and by the
  set of instance attributes (a subclass, or a future mlx-lm release that adds state, is refused
  rather than restored approximately). Accepted: `KVCache`, `QuantizedKVCache`,
  `RotatingKVCache` (with its position state: `offset`, `_idx`, `keep`, `max_size`),
  `ArraysCache` (recurrent state) and `CacheList` of those.
- Key/value caches are stored compact (exactly `offset` positions), so `nbytes` is what the
  snapshot really holds. A restored cache's first write outgrows that size and reallocates, as
  the live cache would have.

Trimming (restoring fewer tokens than were snapshotted) is allowed only when every layer can drop
its last tokens exactly: `KVCache` and `QuantizedKVCache` always; `RotatingKVCache` only while it
has never dropped a token (`offset <= max_size`, positions in temporal order); `ArraysCache` never
(a recurrent state cannot be rewound), so such snapshots are usable at their exact length only.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from trio_mlx.engine.prompt_cache import make_cache

__all__ = [
    "KVSnapshot",
    "SnapshotSupport",
    "SnapshotUnsupported",
    "cache_support",
    "probe_snapshot_support",
    "restore",
    "snapshot",
    "snapshot_prefix",
]


class SnapshotUnsupported(ValueError):
    """The cache (or the requested restore) cannot be snapshotted/restored exactly."""


# The instance attributes each accepted class carries; anything else means state we don't know.
_KNOWN_ATTRIBUTES: dict[type, frozenset[str]] = {
    KVCache: frozenset({"keys", "values", "offset"}),
    QuantizedKVCache: frozenset({"keys", "values", "offset", "group_size", "bits"}),
    RotatingKVCache: frozenset({"keys", "values", "offset", "keep", "max_size", "_idx"}),
    ArraysCache: frozenset({"cache", "left_padding", "lengths"}),
    CacheList: frozenset({"caches"}),
}

# Classes whose snapshots may be trimmed (RotatingKVCache: only while it has not wrapped).
_TRIMMABLE_CLASSES = (KVCache, QuantizedKVCache, RotatingKVCache)


@dataclass(frozen=True)
class SnapshotSupport:
    """What `probe_snapshot_support` found about a model's cache (reported in the stats).

    `supported`: every layer's cache can be snapshotted and restored exactly; when False the engine
    runs this model uncached. `trimmable`: snapshots can be restored at a shorter length (for
    `RotatingKVCache` only while the window has not wrapped, checked per snapshot). `reason`
    explains either answer in one line. `layer_types` names each layer's cache class.
    """

    supported: bool
    trimmable: bool
    reason: str
    layer_types: tuple[str, ...]


# ---- per-layer states -------------------------------------------------------------------------


def _own(x: Any) -> Any:
    """A new array object with the value of `x` (sharing its buffer): an in-place write through
    either object then leaves the other unchanged. None stays None."""
    return None if x is None else copy.copy(x)


def _slice_tokens(x: Any, length: int) -> Any:
    """Positions `[0, length)` along axis -2, as a new array object."""
    return x[..., :length, :] if x.shape[-2] != length else _own(x)


def _compact(x: Any, length: int) -> Any:
    """A new array holding exactly positions `[0, length)` of `x` along axis -2 (a copy whenever
    `x` holds more, so the snapshot does not keep the live cache's spare capacity alive)."""
    if x.shape[-2] == length:
        return _own(x)
    return mx.contiguous(x[..., :length, :])


@dataclass(frozen=True)
class _KVLayer:
    keys: Any
    values: Any
    offset: int

    trimmable = True

    @classmethod
    def take(cls, c: KVCache, upto: int | None = None) -> _KVLayer:
        n = _cut(c.offset, upto)
        if c.keys is None:
            return cls(None, None, 0)
        return cls(_compact(c.keys, n), _compact(c.values, n), n)

    def arrays(self) -> list[Any]:
        return [a for a in (self.keys, self.values) if a is not None]

    def build(self, length: int) -> KVCache:
        c = KVCache()
        if self.keys is not None and length > 0:
            c.keys = _slice_tokens(self.keys, length)
            c.values = _slice_tokens(self.values, length)
            c.offset = length
        return c


@dataclass(frozen=True)
class _QuantizedLayer:
    keys: tuple[Any, ...] | None  # (packed, scales, biases)
    values: tuple[Any, ...] | None
    offset: int
    group_size: int
    bits: int

    trimmable = True

    @classmethod
    def take(cls, c: QuantizedKVCache, upto: int | None = None) -> _QuantizedLayer:
        n = _cut(c.offset, upto)
        if c.keys is None:
            return cls(None, None, 0, c.group_size, c.bits)
        keys = tuple(_compact(x, n) for x in c.keys)
        values = tuple(_compact(x, n) for x in c.values)
        return cls(keys, values, n, c.group_size, c.bits)

    def arrays(self) -> list[Any]:
        return [*(self.keys or ()), *(self.values or ())]

    def build(self, length: int) -> QuantizedKVCache:
        c = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is not None and self.values is not None and length > 0:
            keys = tuple(_slice_tokens(x, length) for x in self.keys)
            values = tuple(_slice_tokens(x, length) for x in self.values)
            c.state = (keys, values, length, self.group_size, self.bits)
        return c


@dataclass(frozen=True)
class _RotatingLayer:
    keys: Any
    values: Any
    offset: int
    idx: int
    keep: int
    max_size: int

    @property
    def trimmable(self) -> bool:
        # Never dropped a token: positions [0, offset) are all present, in order.
        return self.idx == self.offset <= self.max_size

    @classmethod
    def take(cls, c: RotatingKVCache, upto: int | None = None) -> _RotatingLayer:
        unwrapped = c._idx == c.offset <= c.max_size
        if upto is not None and not unwrapped:
            raise SnapshotUnsupported("a RotatingKVCache that has dropped tokens cannot be cut")
        n = _cut(c.offset, upto)
        if c.keys is None:
            return cls(None, None, c.offset, c._idx, c.keep, c.max_size)
        if unwrapped:
            # Not wrapped: the first `offset` positions are the whole content, in order.
            keys, values = _compact(c.keys, n), _compact(c.values, n)
            return cls(keys, values, n, n, c.keep, c.max_size)
        # Wrapped (or trimmed by a long prefill): the buffer layout is part of the state.
        return cls(_own(c.keys), _own(c.values), c.offset, c._idx, c.keep, c.max_size)

    def arrays(self) -> list[Any]:
        return [a for a in (self.keys, self.values) if a is not None]

    def build(self, length: int) -> RotatingKVCache:
        c = RotatingKVCache(max_size=self.max_size, keep=self.keep)
        if self.keys is None:
            c.offset, c._idx = self.offset, self.idx
            return c
        if length == self.offset:
            c.keys, c.values = _own(self.keys), _own(self.values)
            c.offset, c._idx = self.offset, self.idx
        else:
            c.keys = _slice_tokens(self.keys, length)
            c.values = _slice_tokens(self.values, length)
            c.offset = c._idx = length
        return c


@dataclass(frozen=True)
class _ArraysLayer:
    states: tuple[Any, ...]
    left_padding: Any
    lengths: Any

    trimmable = False

    @classmethod
    def take(cls, c: ArraysCache, upto: int | None = None) -> _ArraysLayer:
        if upto is not None:
            raise SnapshotUnsupported("a recurrent state (ArraysCache) cannot be cut")
        return cls(tuple(_own(x) for x in c.cache), _own(c.left_padding), _own(c.lengths))

    def arrays(self) -> list[Any]:
        return [a for a in (*self.states, self.left_padding, self.lengths) if a is not None]

    def build(self, length: int) -> ArraysCache:
        c = ArraysCache(len(self.states))
        c.cache = [_own(x) for x in self.states]  # a list of its own: models set `cache[i]`
        c.left_padding, c.lengths = _own(self.left_padding), _own(self.lengths)
        return c


@dataclass(frozen=True)
class _ListLayer:
    children: tuple[_Layer, ...]

    @property
    def trimmable(self) -> bool:
        return all(child.trimmable for child in self.children)

    @classmethod
    def take(cls, c: CacheList, upto: int | None = None) -> _ListLayer:
        return cls(tuple(_take(child, upto) for child in c.caches))

    def arrays(self) -> list[Any]:
        return [a for child in self.children for a in child.arrays()]

    def build(self, length: int) -> CacheList:
        return CacheList(*(child.build(length) for child in self.children))


_Layer = _KVLayer | _QuantizedLayer | _RotatingLayer | _ArraysLayer | _ListLayer


def _take(c: Any, upto: int | None = None) -> _Layer:
    """The layer's state; with `upto`, only its first `upto` tokens (trimmable layers only)."""
    reason = _layer_problem(c)
    if reason is not None:
        raise SnapshotUnsupported(reason)
    if isinstance(c, KVCache):
        return _KVLayer.take(c, upto)
    if isinstance(c, QuantizedKVCache):
        return _QuantizedLayer.take(c, upto)
    if isinstance(c, RotatingKVCache):
        return _RotatingLayer.take(c, upto)
    if isinstance(c, ArraysCache):
        return _ArraysLayer.take(c, upto)
    assert isinstance(c, CacheList)
    return _ListLayer.take(c, upto)


def _cut(offset: int, upto: int | None) -> int:
    """How many tokens to take from a layer holding `offset`."""
    if upto is None:
        return offset
    if not 0 < upto <= offset:
        raise ValueError(f"cannot take the first {upto} tokens of a cache holding {offset}")
    return upto


def _offsets(layer: _Layer) -> list[int]:
    """The token counts the layer itself records (recurrent state records none)."""
    if isinstance(layer, _ListLayer):
        return [n for child in layer.children for n in _offsets(child)]
    if isinstance(layer, _ArraysLayer):
        return []
    return [layer.offset]


def _layer_problem(c: Any) -> str | None:
    """Why `c` cannot be snapshotted exactly, or None when it can."""
    cls = type(c)
    known = _KNOWN_ATTRIBUTES.get(cls)
    if known is None:
        return f"{cls.__name__} is not a cache class whose state can be restored exactly"
    extra = set(vars(c)) - known
    if extra:
        return f"{cls.__name__} carries state this version does not restore: {sorted(extra)}"
    if isinstance(c, CacheList):
        for child in c.caches:
            problem = _layer_problem(child)
            if problem is not None:
                return f"CacheList: {problem}"
    return None


def _layer_type(c: Any) -> str:
    if isinstance(c, CacheList):
        return "CacheList(" + ", ".join(_layer_type(child) for child in c.caches) + ")"
    return type(c).__name__


def _class_trimmable(c: Any) -> bool:
    if isinstance(c, CacheList):
        return all(_class_trimmable(child) for child in c.caches)
    return isinstance(c, _TRIMMABLE_CLASSES)


# ---- public API -------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """An independent copy of a prompt cache's state after `length` tokens (its arrays queued for
    evaluation when it was taken).

    `nbytes` is the memory its arrays hold. `trimmable`: `restore(..., length=n)` accepts any
    `1 <= n <= length`; otherwise only `n == length`. Immutable; restore it any number of times.
    Holds MLX arrays: keep it on the runner thread.
    """

    layers: tuple[_Layer, ...]
    length: int
    nbytes: int
    trimmable: bool


def snapshot(cache: Sequence[Any], length: int | None = None) -> KVSnapshot:
    """Copy the state of the live prompt cache `cache` (one entry per layer, as made by
    `make_prompt_cache`) into a `KVSnapshot`. Queues the copies; does not wait for them.

    `length` is the number of tokens the cache has processed. When omitted it is read from the
    key/value layers; a purely recurrent cache (only `ArraysCache`) records no count, so it must
    be given. When given, every key/value layer must agree with it.

    Raises `SnapshotUnsupported` for a cache class outside the accepted set, and `ValueError` when
    the token count is unknown or inconsistent. Continuing to use `cache` afterwards never
    changes the snapshot.
    """
    layers = tuple(_take(c) for c in cache)
    offsets = {n for layer in layers for n in _offsets(layer)}
    if length is None:
        if len(offsets) != 1:
            raise ValueError(
                "the number of cached tokens cannot be read from this cache "
                f"(layer offsets: {sorted(offsets)}); pass length="
            )
        length = offsets.pop()
    elif offsets - {length}:
        raise ValueError(f"the cache holds {sorted(offsets)} tokens, not length={length}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return _evaluated(layers, length)


def _evaluated(layers: tuple[_Layer, ...], length: int) -> KVSnapshot:
    """The snapshot of `layers`, their copies queued on the device (`mx.async_eval`): the call
    does not wait for computation already queued, e.g. the next decode step (on a GPU that wait
    would be a whole step). The copies are MLX arrays of their own, so what the live cache does
    next, in place or not, cannot reach them; MLX computes them before anything that reads them."""
    arrays = [a for layer in layers for a in layer.arrays()]
    mx.async_eval(arrays)
    return KVSnapshot(
        layers=layers,
        length=length,
        nbytes=sum(int(a.nbytes) for a in arrays),
        trimmable=all(layer.trimmable for layer in layers),
    )


def snapshot_prefix(cache: Sequence[Any], length: int) -> KVSnapshot:
    """Like `snapshot`, of only the first `length` tokens of a live cache that holds more (or
    exactly `length`): what `snapshot` would have returned had it been called when the cache held
    `length` tokens. Only trimmable caches can be cut this way (`KVCache`, `QuantizedKVCache`, a
    `RotatingKVCache` that has not dropped a token, lists of those); others raise
    `SnapshotUnsupported`. Copies only the prefix."""
    layers = tuple(_take(c, length) for c in cache)
    return _evaluated(layers, length)


def restore(snap: KVSnapshot, length: int | None = None) -> list[Any]:
    """A fresh live prompt cache equal to `snap` after its first `length` tokens (default: all).

    The result is independent of `snap` and of every other restored cache: decoding into it
    leaves them unchanged. Raises `SnapshotUnsupported` when `length < snap.length` and the
    snapshot is not trimmable, `ValueError` when `length` is not in `1..snap.length`.
    """
    if length is None:
        length = snap.length
    if length != snap.length:
        if not 1 <= length < snap.length:
            raise ValueError(f"length must be in 1..{snap.length}, got {length}")
        if not snap.trimmable:
            raise SnapshotUnsupported(
                "this snapshot holds recurrent or wrapped state: it can only be restored at "
                f"its full length ({snap.length} tokens)"
            )
    return [layer.build(length) for layer in snap.layers]


def cache_support(cache: Sequence[Any]) -> SnapshotSupport:
    """`SnapshotSupport` for a live cache's layer classes (see `probe_snapshot_support`)."""
    types = tuple(_layer_type(c) for c in cache)
    if not cache:
        return SnapshotSupport(False, False, "the model makes an empty cache", types)
    for i, c in enumerate(cache):
        problem = _layer_problem(c)
        if problem is not None:
            return SnapshotSupport(False, False, f"layer {i}: {problem}", types)
    if all(_class_trimmable(c) for c in cache):
        if any("RotatingKVCache" in t for t in types):
            reason = "key/value caches; a rotating window is trimmable until it wraps"
        else:
            reason = "key/value caches: snapshots restore exactly and can be trimmed"
        return SnapshotSupport(True, True, reason, types)
    return SnapshotSupport(
        True,
        False,
        "recurrent state (ArraysCache): snapshots restore exactly at their own length only",
        types,
    )


def probe_snapshot_support(model: Any, max_kv_size: int | None = None) -> SnapshotSupport:
    """Whether this model's prompt cache (as the engine builds it: `prompt_cache.make_cache(model,
    max_kv_size)`) can take part in prefix caching. Call once at load."""
    return cache_support(make_cache(model, max_kv_size))
