"""Hermes, Qwen2.5, Qwen3 (and the fallback format of templates that know no tools):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one JSON object per `<tool_call>` block, several blocks for parallel calls."""

from __future__ import annotations

from trio_mlx.tools.json_calls import calls_in_json
from trio_mlx.tools.sections import PartialCall, SectionFormat

START = "<tool_call>"
END = "</tool_call>"


class HermesFormat(SectionFormat):
    name = "hermes"
    start_markers = (START,)

    def section_end(self, section: str) -> int | None:
        index = section.find(END)
        return None if index < 0 else index + len(END)

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        body = section[len(START) :]
        if body.endswith(END):
            body, complete = body[: -len(END)], True
        calls, _ = calls_in_json(body, 0, complete)
        return calls
