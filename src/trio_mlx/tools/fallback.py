"""Tools for a model whose chat template knows none (the bundled SmolLM2's, Gemma 3's): a system
prompt that describes the tools and the Hermes `<tool_call>` format, and a conversation's earlier
calls and results written in that format, so that the template renders them as plain text.

The prompt (`tools_system_prompt`) reads:

    You can call functions to answer. These are the functions, as JSON Schema:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
    </tools>
    To call a function, reply with one block per call:
    <tool_call>
    {"name": "<function name>", "arguments": {<the arguments as JSON>}}
    </tool_call>
    The results come back in <tool_response></tool_response> blocks. When no function is
    needed, answer directly.

followed by the `tool_choice` instruction when the request requires a call. The model's reply
is then read by the Hermes parser; a format named with `--tool-call-parser` reads it instead,
and where that format has its own `fallback_syntax` (Gemma 3's `tool_code` blocks) the prompt
asks for that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from trio_mlx.tools.calls import ToolCall

#: How the prompt asks for a call in the Hermes format (the default).
HERMES_SYNTAX = (
    "To call a function, reply with one block per call:\n"
    "<tool_call>\n"
    '{"name": "<function name>", "arguments": {<the arguments as JSON>}}\n'
    "</tool_call>"
)


def tools_system_prompt(
    tools: Sequence[Mapping[str, Any]],
    instruction: str | None = None,
    call_syntax: str = HERMES_SYNTAX,
) -> str:
    """The system prompt text that offers `tools` (OpenAI's `{"type": "function", ...}`);
    `call_syntax` says how to write a call (a format's `fallback_syntax`)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    lines = [
        "You can call functions to answer. These are the functions, as JSON Schema:",
        "<tools>",
        listed,
        "</tools>",
        call_syntax,
        "The results come back in <tool_response></tool_response> blocks. When no function is "
        "needed, answer directly.",
    ]
    if instruction:
        lines.append(instruction)
    return "\n".join(lines)


def calls_as_text(calls: Sequence[ToolCall]) -> str:
    """An assistant turn's calls as the Hermes blocks the model is asked to write."""
    blocks = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.arguments)
        except ValueError:
            arguments = call.arguments
        payload = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{payload}\n</tool_call>")
    return "\n".join(blocks)


def result_as_text(content: str) -> str:
    """A tool's result as the block the prompt says results come in."""
    return f"<tool_response>\n{content}\n</tool_response>"
