"""Stop strings matched across token boundaries.

Text that might be the beginning of a stop string is held back until it either completes the stop
string (the generation ends and the stop string is not emitted) or cannot any more (it is released).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds on text deltas; says what may be emitted and whether a stop string was reached."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped_by: str | None = None

    @property
    def held(self) -> str:
        """Text not emitted yet because it may start a stop string."""
        return self._held

    def feed(self, text: str) -> tuple[str, bool]:
        """Add `text`; return what may be emitted now, and whether a stop string matched."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        first: tuple[int, str] | None = None
        for stop in self._stops:
            index = buffer.find(stop)
            if index >= 0 and (first is None or index < first[0]):
                first = (index, stop)
        if first is not None:
            self._held = ""
            self.stopped_by = first[1]
            return buffer[: first[0]], True
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The generation ended for another reason: release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
