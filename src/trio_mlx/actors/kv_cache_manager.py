"""The kv_cache actor: the book of cached prefixes (`PrefixCache`) and the decision whether a model
takes part in prefix caching at all.

The snapshots themselves (MLX arrays) stay on the runner thread, in the `SnapshotKeeper`'s dict
keyed by the book's entry ids. Every change to the book is made *by the runner thread*, with a
direct call, at the moment the runner changes its dict:
- `plan(prompt)` before a prefill: the hit to restore (or None);
- `stored(...)` right after it took a snapshot: the book's decision (keep it under which id, which
  ids to drop), applied to the dict before the runner does anything else;
- `forget(entry_id)` when a hit's snapshot cannot be restored (the runner then prefills in full);
- `clear()` when the runner drops every snapshot (`Engine.clear_runtime_caches`).
The runner never waits for the event loop to consult the book: the book is guarded by a
`threading.Lock`, and every method holding it is short synchronous work (a radix-tree walk, a
few dict updates) with no I/O and no `await`, so the longest the runner can wait is one such
call made by the Trio thread (`statistics`, `store_points`). Because the runner changes the book
and its dict together, a lookup never names a snapshot the runner has not got, and a snapshot is
entered in the book only once it is complete (a prefill cancelled half way leaves nothing
behind). The runner stores a request's final snapshot before it delivers that request's finish,
so a client that has seen a request finish always finds its final entry in the book.

From the Trio thread: `store_points` (when a job is built), `statistics()` (any task), and
`clear()` once the runner no longer serves.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from trio_mlx.actors.kv_cache import CacheHit, CacheKind, PrefixCache, StoreDecision
from trio_mlx.engine.kv_snapshots import SnapshotSupport

__all__ = ["MAX_DEFAULT_BUDGET", "MIN_DEFAULT_BUDGET", "KVCacheManager", "default_budget"]

MIB = 1024 * 1024
#: The default budget is half the weights' size, within these bounds.
MIN_DEFAULT_BUDGET = 256 * MIB
MAX_DEFAULT_BUDGET = 8 * 1024 * MIB


def default_budget(weights_bytes: int) -> int:
    """The snapshot memory budget when none is configured: half the size of the model's weights,
    at least 256 MiB (a few long prompts of a small model) and at most 8 GiB."""
    return max(MIN_DEFAULT_BUDGET, min(MAX_DEFAULT_BUDGET, weights_bytes // 2))


class KVCacheManager:
    """Owns the book of cached prefixes for one model and whether caching applies.

    Caching is `enabled` when the budget is positive and the model's cache probed as
    snapshot-able (`support.supported`); when disabled every request runs uncached, and the
    runner never calls in. `exact_prompt_limit` (see `prompt_cache.chunking_exact_limit`): longer
    prompts are neither looked up nor stored, since their output would depend on where the
    prefill was split; they count as `bypassed`. Thread-safe (see the module docstring).
    """

    def __init__(
        self,
        budget_bytes: int,
        support: SnapshotSupport,
        *,
        exact_prompt_limit: int | None = None,
        budget_source: str = "configured",
    ) -> None:
        self.support = support
        self.exact_prompt_limit = exact_prompt_limit
        self.budget_source = budget_source
        self._prefixes = PrefixCache(budget_bytes)
        self._lock = threading.Lock()
        self.enabled = budget_bytes > 0 and support.supported
        self.bypassed = 0
        self.restore_failures = 0

    @classmethod
    def for_model(
        cls,
        cache_memory_bytes: int | None,
        support: SnapshotSupport,
        *,
        weights_bytes: int,
        exact_prompt_limit: int | None = None,
    ) -> KVCacheManager:
        """The manager for a loaded model: `cache_memory_bytes` None picks `default_budget`."""
        if cache_memory_bytes is None:
            return cls(
                default_budget(weights_bytes),
                support,
                exact_prompt_limit=exact_prompt_limit,
                budget_source="default",
            )
        if cache_memory_bytes < 0:
            raise ValueError(f"cache_memory_bytes must be >= 0, got {cache_memory_bytes}")
        return cls(cache_memory_bytes, support, exact_prompt_limit=exact_prompt_limit)

    # ---- called by the runner thread, directly ------------------------------------------

    def plan(self, prompt_tokens: Sequence[int], align: int = 1) -> CacheHit | None:
        """The cached prefix to restore before prefilling `prompt_tokens`, or None; with
        `align`, a trimmable prefix ends on a multiple of it (`PrefixCache.lookup`)."""
        if not self.enabled:
            return None
        with self._lock:
            if not self.accepts(len(prompt_tokens)):
                self.bypassed += 1
                return None
            return self._prefixes.lookup(prompt_tokens, align)

    def store_points(self, prompt_length: int, system_prefix: int | None) -> tuple[int, ...]:
        """Prompt lengths at which the runner should snapshot during prefill: the chat's
        `system_prefix`, and the prompt but its last token where the final entry cannot serve a
        retry (a cache that cannot be trimmed, or a bounded one the completion may overflow)."""
        if not self.accepts(prompt_length):
            return ()
        points = [] if system_prefix is None else [system_prefix]
        if not self.support.trimmable or self.exact_prompt_limit is not None:
            points.append(prompt_length - 1)
        return tuple(sorted(p for p in set(points) if 0 < p < prompt_length))

    def accepts(self, length: int) -> bool:
        """Whether a prompt, or a snapshot, of `length` tokens takes part in caching."""
        limit = self.exact_prompt_limit
        return self.enabled and length > 0 and (limit is None or length <= limit)

    def stored(
        self, tokens: Sequence[int], nbytes: int, kind: CacheKind, trimmable: bool
    ) -> StoreDecision:
        """The runner holds a new snapshot of `tokens`: the book's decision about it."""
        with self._lock:
            return self._prefixes.store(tokens, nbytes, kind, trimmable)

    def forget(self, entry_id: int) -> None:
        """A hit's snapshot could not be restored: drop the entry (the request ran uncached)."""
        with self._lock:
            self.restore_failures += 1
            self._prefixes.remove(entry_id)

    def clear(self) -> tuple[int, int]:
        """Empty the book; returns (entries, bytes) it held. Counters are kept."""
        with self._lock:
            entries, nbytes = len(self._prefixes), self._prefixes.nbytes
            self._prefixes.clear()
            return entries, nbytes

    # ---- read by anyone -------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        """JSON-serialisable counters and facts (what `Engine.get_cache_stats()` returns), all
        of one moment."""
        with self._lock:
            s = self._prefixes.statistics()
            by_kind = dict(Counter(e.kind for e in self._prefixes.entries()))
            bypassed, restore_failures = self.bypassed, self.restore_failures
        support = self.support
        return {
            "enabled": self.enabled,
            "supported": support.supported,
            "trimmable": support.trimmable,
            "support_reason": support.reason,
            "cache_types": dict(Counter(support.layer_types)),
            "exact_prompt_limit": self.exact_prompt_limit,
            "entries": s.entries,
            "entries_by_kind": by_kind,
            "bytes": s.bytes,
            "budget_bytes": s.budget,
            "budget_source": self.budget_source,
            "hits": s.hits,
            "misses": s.misses,
            "hit_ratio": s.hit_ratio,
            "tokens_saved": s.tokens_saved,
            "stores": s.stores,
            "refreshes": s.refreshes,
            "refused": s.refused,
            "evictions": s.evictions,
            "superseded": s.superseded,
            "bypassed": bypassed,
            "restore_failures": restore_failures,
        }
