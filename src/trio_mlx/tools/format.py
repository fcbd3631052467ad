"""What every tool-call format provides: a parser per output (`stream`), whole-text parsing on
top of it (`parse`), and the tools it reads calls of (their names and parameter types)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from trio_mlx.tools.events import ParsedOutput, ToolEvent, collect
from trio_mlx.tools.schemas import ToolSchemas


class ToolCallStream(ABC):
    """An incremental parser of one output: feed it text deltas, then `finish` at the end."""

    @abstractmethod
    def feed(self, text: str) -> list[ToolEvent]: ...

    @abstractmethod
    def finish(self) -> list[ToolEvent]: ...


class ToolFormat(ABC):
    """A model family's tool-call format: makes one parser per output."""

    #: The name `--tool-call-parser` takes.
    name: ClassVar[str]
    #: How a prompt for a template that knows no tools asks for a call in this format (None:
    #: in the Hermes format, `fallback.HERMES_SYNTAX`).
    fallback_syntax: ClassVar[str | None] = None

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = ToolSchemas(tools)

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's content and calls."""
        stream = self.stream()
        return collect([*stream.feed(text), *stream.finish()])
