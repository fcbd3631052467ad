"""What an incremental tool-call parser reports as model text arrives, and the whole-text result.

A parser turns the model's text into events in order: `Content` (text safe to show the user, no
markup in it), `Reasoning` (thinking a format keeps in its own channel, as gpt-oss's `analysis`),
`CallStarted` (a call's index, id and name, once the name is complete) and `ArgumentsAppended`
(the next piece of that call's arguments JSON text). The pieces of one call's arguments, joined,
are its whole `arguments`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trio_mlx.tools.calls import ToolCall


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsAppended:
    index: int
    text: str


ToolEvent = Content | Reasoning | CallStarted | ArgumentsAppended


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: its content and reasoning with the markup taken out, and its calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


def collect(events: Iterable[ToolEvent]) -> ParsedOutput:
    """The events of one output folded into its content, reasoning and calls."""
    content: list[str] = []
    reasoning: list[str] = []
    starts: list[CallStarted] = []
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, Reasoning):
            reasoning.append(event.text)
        elif isinstance(event, CallStarted):
            starts.append(event)
            arguments.setdefault(event.index, [])
        else:
            arguments.setdefault(event.index, []).append(event.text)
    calls = [
        ToolCall(start.name, "".join(arguments[start.index]) or "{}", start.id) for start in starts
    ]
    return ParsedOutput("".join(content), calls, "".join(reasoning))
