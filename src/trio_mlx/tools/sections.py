"""The streaming engine for formats that write calls as marked sections inside the text.

A format (`SectionFormat`) says where a section of calls starts (`start_markers` anywhere, or
`leading_markers` only before any other text), where it ends (`section_end`; EOS where there is
no end marker), and what calls a section holds so far (`scan`). `SectionStream` does the rest the
same way for every format: text outside sections is content, emitted as soon as no start marker
can begin in it; a call is announced once its name is complete, and its arguments are sent as
they grow. Whitespace just before a section is dropped; a complete section in which the format
finds no call is given back as content, so unknown markup is never lost.

Whole-text parsing is the same machine fed once (`parse`): streaming the text in any pieces gives
the same content and calls as parsing it whole.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from trio_mlx.tools.calls import new_call_id
from trio_mlx.tools.events import ArgumentsAppended, CallStarted, Content, ToolEvent
from trio_mlx.tools.format import ToolCallStream, ToolFormat
from trio_mlx.tools.markup import partial_marker_suffix


@dataclass(frozen=True)
class PartialCall:
    """A call as far as a section shows it: the name (complete) and the settled part of its
    arguments text. A later scan of the same section reports arguments that extend these."""

    name: str
    arguments: str = ""
    id: str | None = None


class SectionFormat(ToolFormat):
    start_markers: ClassVar[tuple[str, ...]] = ()
    leading_markers: ClassVar[tuple[str, ...]] = ()

    def section_end(self, section: str) -> int | None:
        """Where `section` (from its start marker on) ends: the index just past its end marker,
        or None while it has not ended. The default: sections last to the end of the output."""
        return None

    @abstractmethod
    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        """The calls in `section` so far; `complete` when nothing more will be added to it."""

    def stream(self) -> SectionStream:
        return SectionStream(self)


class SectionStream(ToolCallStream):
    def __init__(self, format: SectionFormat) -> None:
        self._format = format
        self._held = ""
        self._section: str | None = None
        self._seen_text = False
        self._calls = 0  # calls finished in earlier sections
        self._open: list[tuple[str, str]] = []  # this section's calls: (id, arguments sent)

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        buffer = self._held + text
        self._held = ""
        while True:
            if self._section is None:
                if not buffer:
                    break
                start = self._find_start(buffer)
                if start is None:
                    keep = self._holdback(buffer)
                    self._content(events, buffer[: len(buffer) - keep])
                    self._held = buffer[len(buffer) - keep :]
                    break
                self._content(events, buffer[:start].rstrip())
                self._section, buffer = buffer[start:], ""
                continue
            self._section += buffer
            buffer = ""
            end = self._format.section_end(self._section)
            if end is None:
                self._update(events, self._format.scan(self._section, False))
                break
            body, buffer = self._section[:end], self._section[end:]
            self._close(events, body)
        return events

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._section is not None:
            self._close(events, self._section)
        if self._held:
            events.append(Content(self._held))
            self._held = ""
        return events

    def _find_start(self, buffer: str) -> int | None:
        found: int | None = None
        for marker in self._format.start_markers:
            index = buffer.find(marker)
            if index >= 0 and (found is None or index < found):
                found = index
        if not self._seen_text and self._format.leading_markers:
            stripped = buffer.lstrip()
            if stripped.startswith(self._format.leading_markers):
                index = len(buffer) - len(stripped)
                if found is None or index < found:
                    found = index
        return found

    def _holdback(self, buffer: str) -> int:
        """How much of the end of `buffer` may still become markup (or precede it)."""
        keep = partial_marker_suffix(buffer, self._format.start_markers)
        if not self._seen_text and self._format.leading_markers:
            stripped = buffer.lstrip()
            if any(m.startswith(stripped) for m in self._format.leading_markers):
                return len(buffer)
        rest = buffer[: len(buffer) - keep]
        return keep + len(rest) - len(rest.rstrip())

    def _content(self, events: list[ToolEvent], text: str) -> None:
        if text:
            events.append(Content(text))
            if text.strip():
                self._seen_text = True

    def _update(self, events: list[ToolEvent], calls: list[PartialCall]) -> None:
        for i, call in enumerate(calls):
            index = self._calls + i
            if i >= len(self._open):
                call_id = call.id or new_call_id()
                events.append(CallStarted(index, call_id, call.name))
                self._open.append((call_id, ""))
            call_id, sent = self._open[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                events.append(ArgumentsAppended(index, call.arguments[len(sent) :]))
                self._open[i] = (call_id, call.arguments)

    def _close(self, events: list[ToolEvent], body: str) -> None:
        calls = self._format.scan(body, True)
        self._section = None
        if not calls and not self._open:
            self._content(events, body)
            return
        self._seen_text = True
        self._update(events, calls)
        for i, (_, sent) in enumerate(self._open):
            if not sent:
                events.append(ArgumentsAppended(self._calls + i, "{}"))
        self._calls += len(self._open)
        self._open = []
