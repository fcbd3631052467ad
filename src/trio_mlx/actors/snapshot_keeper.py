"""The runner thread's half of the prefix cache: the snapshots themselves (MLX arrays), keyed by the
book's entry ids. The book (`KVCacheManager`: keys, sizes, LRU order, counters) is thread-safe;
the keeper consults and changes it with direct calls from the runner thread — never a round trip
through the event loop — at the moment it changes its own dict, so the two never disagree about
what is stored for longer than one call.

Every method runs on the runner thread, between two steps:
- `restore_for(job)`: ask the book for the longest cached prefix of the prompt; on a hit, a
  restored copy of that snapshot (never the snapshot itself) and its length. A hit whose snapshot
  is missing (evicted meanwhile) or fails to restore is forgotten and the job prefills in full.
- `store(seq, kind, length)`: snapshot what the sequence's cache holds now (its `fed_tokens`),
  or only its first `length` tokens, enter it in the book, keep it if the book took it, and
  drop what the book evicted to make room.
- `clear()`: drop every snapshot, empty the book, free MLX's buffer cache.
- `drop_all()`: release every snapshot (the runner is stopping; MLX arrays are freed on the
  thread that made them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from trio_mlx.actors.kv_cache import CacheKind
from trio_mlx.actors.kv_cache_manager import KVCacheManager
from trio_mlx.engine.decode import GenerationJob
from trio_mlx.engine.kv_snapshots import KVSnapshot, restore, snapshot, snapshot_prefix

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """What `store` reads of a sequence (`decode.ActiveSequence` and the others like it): its
    job, its live cache, and the tokens that cache holds."""

    @property
    def job(self) -> GenerationJob: ...

    @property
    def cache(self) -> list[Any]: ...

    def fed_tokens(self) -> tuple[int, ...]: ...


@dataclass
class SnapshotCounters:
    """Written by the runner thread only; read by anyone (plain numbers)."""

    #: snapshots taken, their total seconds, those that failed, restores done, snapshots held now
    #: (the tokens restored are the book's `tokens_saved`)
    snapshots_taken: int = 0
    snapshot_seconds: float = 0.0
    snapshot_failures: int = 0
    restores: int = 0
    snapshots_held: int = 0


class SnapshotKeeper:
    """Holds the snapshots of one runner. Built on the Trio thread; used on the runner thread."""

    def __init__(self) -> None:
        self.counters = SnapshotCounters()
        self._manager: KVCacheManager | None = None
        self._snapshots: dict[int, KVSnapshot] = {}

    def attach(self, manager: KVCacheManager) -> None:
        """Use `manager` as the book (before the first job is submitted)."""
        self._manager = manager

    def _book(self) -> KVCacheManager | None:
        manager = self._manager
        return manager if manager is not None and manager.enabled else None

    def restore_for(self, job: GenerationJob, align: int = 1) -> tuple[list[Any] | None, int]:
        """The cache to start `job` from and how many prompt tokens it holds; (None, 0) means a
        fresh cache and a full prefill. `align`: see `KVCacheManager.plan`."""
        manager = self._book()
        if manager is None:
            return None, 0
        hit = manager.plan(job.prompt_tokens, align)
        if hit is None:
            return None, 0
        snap = self._snapshots.get(hit.entry_id)
        if snap is not None:
            try:
                cache = restore(snap, hit.length)
            except Exception:
                log.exception("snapshot %d could not be restored", hit.entry_id)
            else:
                self.counters.restores += 1
                return cache, hit.length
        # Evicted meanwhile, or unusable: forget it and prefill everything.
        self._snapshots.pop(hit.entry_id, None)
        self.counters.snapshots_held = len(self._snapshots)
        manager.forget(hit.entry_id)
        return None, 0

    def store(self, seq: SnapshotSource, kind: CacheKind, length: int | None = None) -> None:
        """Snapshot what `seq`'s cache holds now, or its first `length` tokens, and enter it in
        the book (at a step boundary). A sequence whose cache is not exactly its tokens' (its
        `snapshot_safe` False: a SpecPrefill sparse prefill, a drafted media request's cache held
        by mlx-vlm) is never stored."""
        if not getattr(seq, "snapshot_safe", True):
            return
        manager = self._book()
        if manager is None:
            return
        tokens = seq.fed_tokens()
        cut = length is not None and length < len(tokens)
        if cut:
            tokens = tokens[:length]
        if not manager.accepts(len(tokens)):
            return
        began = time.perf_counter()
        try:
            if cut:
                snap = snapshot_prefix(seq.cache, len(tokens))
            else:
                snap = snapshot(seq.cache, len(tokens))
        except Exception:
            log.exception("request %d: the cache could not be snapshotted", seq.job.request_id)
            self.counters.snapshot_failures += 1
            return
        self.counters.snapshots_taken += 1
        self.counters.snapshot_seconds += time.perf_counter() - began
        try:
            decision = manager.stored(tokens, snap.nbytes, kind, snap.trimmable)
        except Exception:  # the book refused in some unforeseen way: keep serving, uncached
            log.exception("request %d: the snapshot could not be entered", seq.job.request_id)
            self.counters.snapshot_failures += 1
            return
        for entry_id in decision.dropped:
            self._snapshots.pop(entry_id, None)
        if decision.stored:
            assert decision.entry_id is not None
            self._snapshots[decision.entry_id] = snap
        self.counters.snapshots_held = len(self._snapshots)

    def clear(self) -> dict[str, int]:
        """Drop every snapshot, empty the book, free MLX's buffer cache; what was freed."""
        import mlx.core as mx

        entries, nbytes = (0, 0)
        if self._manager is not None:
            entries, nbytes = self._manager.clear()
        held = len(self._snapshots)
        held_bytes = sum(snap.nbytes for snap in self._snapshots.values())
        self.drop_all()
        mx.clear_cache()
        return {
            "entries": entries,
            "bytes": nbytes,
            "snapshots": held,
            "snapshot_bytes": held_bytes,
        }

    def drop_all(self) -> None:
        self._snapshots.clear()
        self.counters.snapshots_held = 0
