"""Small text helpers every format's parser shares: what to hold back of a growing text."""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_suffix(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of `text` that is the beginning of one of `markers`
    (not a whole marker): text that may still turn into markup, to hold back."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def stable_prefix(text: str, end_markers: Iterable[str]) -> str:
    """The part of a growing value that later text cannot change: without a trailing piece
    that may be the start of an end marker, and without trailing whitespace (which may turn
    out to precede the end marker)."""
    keep = len(text) - partial_marker_suffix(text, end_markers)
    return text[:keep].rstrip()


def cut_at_first(text: str, markers: Iterable[str]) -> tuple[int, str] | None:
    """Where the earliest of `markers` starts in `text`, and which one it is."""
    best: tuple[int, str] | None = None
    for marker in markers:
        index = text.find(marker)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, marker)
    return best
