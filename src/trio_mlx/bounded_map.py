"""A map bounded by its number of entries and by the bytes they take, the oldest evicted first.

The server's in-memory stores keep their entries in one (`http.responses.store.ResponseStore`,
`http.conversations.store.ConversationStore`, the ended responses of
`http.responses.background.BackgroundResponses`), and so do the engine's cache of vision
features (`multimodal.vision.VisionFeatureCache`) and of compiled grammars
(`structured.compiler`, bounded by count alone: its entries are put as 0 bytes). The contract:

- Each entry is put with its size in bytes, which the caller measures; the map adds them up
  (`bytes`). It holds at most `max_count` entries and `max_bytes` bytes in all.
- Entries are kept in order, the oldest first: an entry is the newest when it is put (putting a
  key again replaces its entry and makes it the newest) or when it is touched (`touch`). A store
  that evicts the least recently used touches an entry when it reads it; one that evicts the
  oldest never touches. `get` leaves an entry's place as it is.
- When a put or a resize leaves the map beyond a bound, the oldest entries are evicted until
  both bounds hold again, never the entry put or resized: should eviction reach that one, it is
  moved to the newest place and the next oldest goes instead. `evicted` counts the entries
  evicted; an entry replaced by a put of its key or removed with `pop` is not counted.
- An entry larger than `max_bytes` alone is not put (`put` returns False and changes nothing,
  an entry already under its key included). A `max_count` of 0 keeps nothing; a `max_bytes` of
  0 keeps only entries of 0 bytes.
- An entry's size may change while it is kept (`resize`): the total follows, and the oldest
  other entries are evicted as after a put. Resizing never evicts the resized entry itself, even
  beyond `max_bytes`: a caller that must not exceed the budget checks the new size first. Left
  so, every other entry is evicted, and the map holds that one alone until it shrinks or goes.

Not thread-safe: each map is used from one thread (the stores from the Trio thread, the vision
cache from the runner's) or under its owner's lock (the grammar cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedMap(Generic[K, V]):
    """At most `max_count` entries and `max_bytes` bytes, the oldest evicted first (see the
    module docstring)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max(0, max_count)
        self.max_bytes = max(0, max_bytes)
        self._values: OrderedDict[K, V] = OrderedDict()
        self._sizes: dict[K, int] = {}
        self._bytes = 0
        #: How many entries were evicted to keep the bounds.
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: K) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[K]:
        """The keys, the oldest first."""
        return iter(self._values)

    @property
    def bytes(self) -> int:
        """The sizes of the entries kept, added up."""
        return self._bytes

    def get(self, key: K) -> V | None:
        """The entry under `key`, or None; its place is left as it is."""
        return self._values.get(key)

    def touch(self, key: K) -> None:
        """Make the entry under `key` the newest (the most recently used); KeyError if none."""
        self._values.move_to_end(key)

    def put(self, key: K, value: V, size: int) -> bool:
        """Keep `value` under `key` as the newest entry, taking `size` bytes, and evict the
        oldest others until both bounds hold; whether it is kept (not when `max_count` is 0 or
        `size` is more than `max_bytes`)."""
        if self.max_count == 0 or size > self.max_bytes:
            return False
        self.pop(key)
        self._values[key] = value
        self._sizes[key] = size
        self._bytes += size
        self._evict(keep=key)
        return True

    def resize(self, key: K, size: int) -> None:
        """The entry under `key` now takes `size` bytes: evict the oldest others until both
        bounds hold, never this one (see the module docstring); KeyError if none."""
        old = self._sizes[key]
        self._sizes[key] = size
        self._bytes += size - old
        self._evict(keep=key)

    def clear(self) -> None:
        """Remove every entry (not counted as evicted)."""
        self._values.clear()
        self._sizes.clear()
        self._bytes = 0

    def pop(self, key: K) -> V | None:
        """Remove the entry under `key` (not counted as evicted); the entry, or None."""
        value = self._values.pop(key, None)
        if key in self._sizes:
            self._bytes -= self._sizes.pop(key)
        return value

    def _evict(self, keep: K) -> None:
        """Evict the oldest entries but `keep` until both bounds hold or `keep` is alone."""
        while len(self._values) > 1 and (
            len(self._values) > self.max_count or self._bytes > self.max_bytes
        ):
            oldest = next(iter(self._values))
            if oldest == keep:
                self._values.move_to_end(oldest)
                oldest = next(iter(self._values))
            self._values.pop(oldest)
            self._bytes -= self._sizes.pop(oldest)
            self.evicted += 1
