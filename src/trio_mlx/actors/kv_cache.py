"""The book of cached prefixes: which token sequences have a KV snapshot, how big each is, which
were used least recently, and the counters the stats report.

`PrefixCache` is the kv_cache actor's state: a plain synchronous class (a call is atomic under
Trio), no Trio, no MLX. It never sees a snapshot: the runner keeps the MLX arrays, keyed by the
entry ids this book hands out, and drops the ids the book says it evicted.

Protocol with the runner:
- before a prefill: `lookup(prompt)` -> `CacheHit` (restore that entry, at `length` tokens,
  trimming when `needs_trim`, and prefill the rest) or None (prefill everything).
- after the runner has taken a snapshot: `store(tokens, nbytes, kind, trimmable)` ->
  `StoreDecision` (keep the new snapshot under `entry_id`, or drop it when refused or refreshed;
  drop every id in `dropped`). The book learns of an entry only once its snapshot exists, so a
  prefill cancelled before that leaves nothing behind and a lookup can never name a snapshot
  that was not completed.
- An entry named by a hit may be evicted before the runner restores it (another store ran in
  between): the runner then finds no snapshot and prefills in full, which is always correct.

Keys live in a radix tree over token ids (edges are runs of tokens), so a long conversation is a
handful of nodes and a lookup compares runs of tokens at C speed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CacheEntry",
    "CacheHit",
    "CacheKind",
    "CacheStats",
    "PrefixCache",
    "StoreDecision",
]

#: "system": the rendered system prompt of a chat; "prompt": a request's prompt but its last token
#: (kept where the final entry is of no use to a retry); "conversation": a prompt + completion.
CacheKind = Literal["system", "prompt", "conversation"]


@dataclass(frozen=True)
class CacheEntry:
    """One cached prefix, as the book knows it (the snapshot itself stays on the runner)."""

    id: int
    tokens: tuple[int, ...]
    nbytes: int
    kind: CacheKind
    #: The snapshot can be restored at any shorter length (not so for recurrent state).
    trimmable: bool
    #: `clock()` at the last store or hit.
    last_used: float


@dataclass(frozen=True)
class CacheHit:
    """Restore entry `entry_id` at its first `length` tokens, then prefill `prompt[length:]`.

    `needs_trim` is True when the entry is longer than `length` (only for trimmable entries).
    `length` is always at least 1 and at most `len(prompt) - 1`.
    """

    entry_id: int
    length: int
    needs_trim: bool


@dataclass(frozen=True)
class StoreDecision:
    """What `PrefixCache.store` decided.

    `entry_id`: the id to keep the new snapshot under; None when the snapshot is larger than the
    whole budget (refused: drop it). `refreshed`: the key was already cached; `entry_id` is that
    existing entry, and the new snapshot is not needed. `evicted`: least-recently-used entries
    dropped to make room. `superseded`: entries whose tokens are a prefix of the new trimmable
    entry, which can serve every lookup they could (kept, they would only take memory).
    """

    entry_id: int | None
    evicted: tuple[int, ...] = ()
    superseded: tuple[int, ...] = ()
    refreshed: bool = False

    @property
    def stored(self) -> bool:
        """The new snapshot is to be kept, under `entry_id`."""
        return self.entry_id is not None and not self.refreshed

    @property
    def dropped(self) -> tuple[int, ...]:
        """Every entry whose snapshot the runner must drop now."""
        return self.evicted + self.superseded


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the book's counters (what `get_cache_stats()` reports)."""

    entries: int
    bytes: int
    budget: int
    hits: int
    misses: int
    stores: int
    refreshes: int
    refused: int
    evictions: int
    superseded: int
    #: Sum of the hits' lengths: prompt tokens that were not prefilled.
    tokens_saved: int

    @property
    def hit_ratio(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class _Entry:
    __slots__ = ("id", "kind", "last_used", "nbytes", "node", "tokens", "trimmable")

    def __init__(
        self,
        entry_id: int,
        tokens: tuple[int, ...],
        nbytes: int,
        kind: CacheKind,
        trimmable: bool,
        last_used: float,
        node: _Node,
    ) -> None:
        self.id = entry_id
        self.tokens = tokens
        self.nbytes = nbytes
        self.kind: CacheKind = kind
        self.trimmable = trimmable
        self.last_used = last_used
        self.node = node

    def public(self) -> CacheEntry:
        return CacheEntry(
            self.id, self.tokens, self.nbytes, self.kind, self.trimmable, self.last_used
        )


class _Node:
    """A radix-tree node: `edge` is the run of tokens from its parent to it."""

    __slots__ = ("children", "edge", "entry", "parent", "trimmable_below")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry: _Entry | None = None
        #: Trimmable entries at this node or under it (to find a trimmable hit without a search).
        self.trimmable_below = 0


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b` (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """The book of cached prefixes under a byte budget, with least-recently-used eviction.

    Entry ids are never reused. Lookups see only stored entries; see the module docstring for the
    protocol with the runner. `clock` stamps `last_used` (tests pass a fake one).
    """

    def __init__(self, budget_bytes: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._budget = budget_bytes
        self._clock = clock
        self._root = _Node((), None)
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 1
        self._bytes = 0
        self._hits = self._misses = self._stores = self._refreshes = self._refused = 0
        self._evictions = self._superseded = self._tokens_saved = 0

    # ---- queries ------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], align: int = 1) -> CacheHit | None:
        """The longest cached prefix usable for a prompt of `tokens`, or None (a miss).

        Candidates: an entry whose tokens are a prefix of `tokens` (used whole), and a trimmable
        entry sharing a longer common prefix with `tokens` (trimmed to it). The hit never covers
        the whole prompt: the last prompt token must be prefilled to produce the first logits, so
        a hit is capped at `len(tokens) - 1` tokens (by trimming, where the entry allows it).
        With `align` > 1 a trimmable entry is only used at a multiple of `align` tokens (trimmed
        down to it; none if that leaves nothing), so that prefill starts on a block boundary.
        A hit refreshes the entry's place in the LRU order and counts its length as saved.
        """
        key = tuple(tokens)
        limit = len(key) - 1
        best_whole: _Entry | None = None  # deepest entry ending on the path
        trim_node: _Node | None = None  # deepest node with a trimmable entry at or below it
        trim_length = 0
        node, depth = self._root, 0
        while True:
            if depth > 0:
                if node.entry is not None:
                    best_whole = node.entry
                if node.trimmable_below:
                    trim_node, trim_length = node, depth
            if depth >= limit:
                break
            child = node.children.get(key[depth])
            if child is None:
                break
            matched = _common_length(child.edge, key[depth:limit])
            if matched < len(child.edge):
                if matched and child.trimmable_below:
                    trim_node, trim_length = child, depth + matched
                break
            node, depth = child, depth + matched

        whole_length = len(best_whole.tokens) if best_whole is not None else 0
        if align > 1:
            trim_length -= trim_length % align
            if best_whole is not None and best_whole.trimmable:
                whole_length -= whole_length % align
                if whole_length == 0:
                    best_whole = None
        if trim_node is not None and trim_length > whole_length:
            entry = self._trimmable_under(trim_node)
            hit = CacheHit(entry.id, trim_length, needs_trim=len(entry.tokens) != trim_length)
        elif best_whole is not None:
            entry = best_whole
            hit = CacheHit(entry.id, whole_length, needs_trim=len(entry.tokens) != whole_length)
        else:
            self._misses += 1
            return None
        self._hits += 1
        self._tokens_saved += hit.length
        self._touch(entry)
        return hit

    def entry(self, entry_id: int) -> CacheEntry | None:
        """The entry `entry_id`, or None if it is not (or no longer) cached."""
        found = self._lru.get(entry_id)
        return found.public() if found is not None else None

    def entries(self) -> list[CacheEntry]:
        """Every entry, least recently used first."""
        return [e.public() for e in self._lru.values()]

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._lru

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def budget(self) -> int:
        return self._budget

    def statistics(self) -> CacheStats:
        return CacheStats(
            entries=len(self._lru),
            bytes=self._bytes,
            budget=self._budget,
            hits=self._hits,
            misses=self._misses,
            stores=self._stores,
            refreshes=self._refreshes,
            refused=self._refused,
            evictions=self._evictions,
            superseded=self._superseded,
            tokens_saved=self._tokens_saved,
        )

    # ---- changes ------------------------------------------------------------------------------

    def store(
        self, tokens: Sequence[int], nbytes: int, kind: CacheKind, trimmable: bool
    ) -> StoreDecision:
        """Record that the runner holds a snapshot of `tokens` (`nbytes` bytes).

        An exact duplicate key refreshes the existing entry instead. A snapshot larger than the
        whole budget is refused. Otherwise, when the new entry is trimmable, entries that are a
        prefix of it are superseded, then least-recently-used entries are evicted until the new
        one fits. See `StoreDecision` for what the runner must do with the answer.
        """
        key = tuple(tokens)
        if not key:
            raise ValueError("an entry needs at least one token")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        existing = self._find(key)
        if existing is not None:
            self._refreshes += 1
            self._touch(existing)
            return StoreDecision(existing.id, refreshed=True)
        if nbytes > self._budget:
            self._refused += 1
            return StoreDecision(None)

        superseded: list[int] = []
        if trimmable:
            superseded = [e.id for e in self._entries_on_path(key)]
            for entry_id in superseded:
                self._drop(entry_id)
            self._superseded += len(superseded)
        evicted: list[int] = []
        while self._bytes + nbytes > self._budget:
            victim = next(iter(self._lru))
            self._drop(victim)
            evicted.append(victim)
        self._evictions += len(evicted)

        node = self._insert(key)
        entry = _Entry(self._next_id, key, nbytes, kind, trimmable, self._clock(), node)
        self._next_id += 1
        node.entry = entry
        if trimmable:
            self._count_trimmable(node, +1)
        self._lru[entry.id] = entry
        self._bytes += nbytes
        self._stores += 1
        return StoreDecision(entry.id, tuple(evicted), tuple(superseded))

    def remove(self, entry_id: int) -> bool:
        """Forget `entry_id` (e.g. its snapshot failed to restore). False if it was not cached."""
        if entry_id not in self._lru:
            return False
        self._drop(entry_id)
        return True

    def clear(self) -> list[int]:
        """Forget every entry; returns their ids (least recently used first). Counters stay."""
        dropped = list(self._lru)
        self._lru.clear()
        self._root = _Node((), None)
        self._bytes = 0
        return dropped

    # ---- internals ----------------------------------------------------------------------------

    def _touch(self, entry: _Entry) -> None:
        entry.last_used = self._clock()
        self._lru.move_to_end(entry.id)

    def _find(self, key: tuple[int, ...]) -> _Entry | None:
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None or key[depth : depth + len(child.edge)] != child.edge:
                return None
            node, depth = child, depth + len(child.edge)
        return node.entry

    def _entries_on_path(self, key: tuple[int, ...]) -> list[_Entry]:
        """Entries whose tokens are a proper prefix of `key`."""
        node, depth = self._root, 0
        found: list[_Entry] = []
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None or key[depth : depth + len(child.edge)] != child.edge:
                break
            node, depth = child, depth + len(child.edge)
            if node.entry is not None and depth < len(key):
                found.append(node.entry)
        return found

    def _trimmable_under(self, node: _Node) -> _Entry:
        """A trimmable entry at or below `node` (the shortest along the way down)."""
        while node.entry is None or not node.entry.trimmable:
            node = next(c for c in node.children.values() if c.trimmable_below)
        return node.entry

    def _insert(self, key: tuple[int, ...]) -> _Node:
        """The node for `key`, created (splitting an edge where needed)."""
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                leaf = _Node(key[depth:], node)
                node.children[key[depth]] = leaf
                return leaf
            matched = _common_length(child.edge, key[depth:])
            if matched < len(child.edge):
                middle = _Node(child.edge[:matched], node)
                middle.trimmable_below = child.trimmable_below
                node.children[key[depth]] = middle
                child.edge = child.edge[matched:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            node, depth = child, depth + matched
        return node

    def _count_trimmable(self, node: _Node | None, change: int) -> None:
        while node is not None:
            node.trimmable_below += change
            node = node.parent

    def _drop(self, entry_id: int) -> None:
        entry = self._lru.pop(entry_id)
        self._bytes -= entry.nbytes
        node = entry.node
        node.entry = None
        if entry.trimmable:
            self._count_trimmable(node, -1)
        # Prune empty leaves, then merge a node left with one child into that child.
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (only,) = node.children.values()
            only.edge = node.edge + only.edge
            only.parent = node.parent
            node.parent.children[only.edge[0]] = only
