"""Separating a reasoning model's thinking (`<think>…</think>`) from its answer, as text streams.

The thinking may open in the prompt (templates that end with `<think>`), so the splitter can start
inside it. A tag split across deltas is held back until it is complete; text after the closing tag
is content. A stray opening tag later in the content is left as content.
"""

from __future__ import annotations


class ReasoningSplitter:
    """Feeds on text deltas; returns each delta's (reasoning, content) parts."""

    def __init__(self, start: str = "<think>", end: str = "</think>", *, thinking: bool = False):
        self._start = start
        self._end = end
        self._thinking = thinking
        self._seen_content = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buffer = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buffer:
            if self._thinking:
                index = buffer.find(self._end)
                if index >= 0:
                    reasoning.append(buffer[:index])
                    buffer = buffer[index + len(self._end) :]
                    self._thinking = False
                    continue
                keep = _partial_suffix(buffer, self._end)
                reasoning.append(buffer[: len(buffer) - keep])
                self._held = buffer[len(buffer) - keep :]
                break
            if not self._seen_content:
                stripped = buffer.lstrip()
                if stripped.startswith(self._start):
                    buffer = stripped[len(self._start) :]
                    self._thinking = True
                    continue
                if self._start.startswith(stripped):
                    self._held = buffer  # may still become the opening tag
                    break
                if not stripped:
                    self._held = buffer
                    break
            self._seen_content = True
            content.append(buffer)
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of the generation: what was held back, as reasoning if inside the thinking."""
        held, self._held = self._held, ""
        return (held, "") if self._thinking else ("", held)


def _partial_suffix(buffer: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(buffer)), 0, -1):
        if buffer.endswith(tag[:n]):
            return n
    return 0
