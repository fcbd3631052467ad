"""Tool calling: the calls a model makes, parsed from its output (one module per family).

Each family's module defines a `ToolFormat`; `registry` picks one from the chat template or by
name; a format's `stream()` is an incremental parser of one output (`events` says what it
reports) and `parse(text)` reads a whole output.
"""

from trio_mlx.tools.calls import ToolCall, new_call_id
from trio_mlx.tools.events import (
    ArgumentsAppended,
    CallStarted,
    Content,
    ParsedOutput,
    Reasoning,
    ToolEvent,
    collect,
)
from trio_mlx.tools.format import ToolCallStream, ToolFormat
from trio_mlx.tools.registry import (
    AUTO,
    FORMATS,
    PARSER_CHOICES,
    detect_format,
    format_class,
    template_knows_tools,
    template_text,
)

__all__ = [
    "AUTO",
    "FORMATS",
    "PARSER_CHOICES",
    "ArgumentsAppended",
    "CallStarted",
    "Content",
    "ParsedOutput",
    "Reasoning",
    "ToolCall",
    "ToolCallStream",
    "ToolEvent",
    "ToolFormat",
    "collect",
    "detect_format",
    "format_class",
    "new_call_id",
    "template_knows_tools",
    "template_text",
]
