"""Gemma 3: its template knows no tools, and the format Google documents for it is a
`tool_code` block of Python calls; Gemma also answers a JSON function-call prompt with the call
as JSON (alone, or in a `json` block) naming an offered function:

    ```tool_code
    get_weather(city="Paris")
    ```
    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

from trio_mlx.tools.json_calls import calls_in_json
from trio_mlx.tools.pythonic import pythonic_calls
from trio_mlx.tools.sections import PartialCall, SectionFormat

TOOL_CODE = "```tool_code"
JSON_BLOCK = "```json"
FENCE = "```"


class Gemma3Format(SectionFormat):
    name = "gemma3"
    fallback_syntax = (
        "To call functions, reply with a tool_code block of Python calls, one a line:\n"
        "```tool_code\n"
        '<function name>(<argument>="<value>", ...)\n'
        "```"
    )
    start_markers = (TOOL_CODE,)
    leading_markers = (JSON_BLOCK, "{")

    def section_end(self, section: str) -> int | None:
        if not section.startswith(FENCE):
            return None
        index = section.find(FENCE, len(FENCE))
        return None if index < 0 else index + len(FENCE)

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        if section.startswith(TOOL_CODE):
            if not complete and not section.endswith(FENCE, len(TOOL_CODE)):
                return []
            body = section[len(TOOL_CODE) :].removesuffix(FENCE)
            return [c for c in pythonic_calls(body) if self.tools.accepts(c.name)]
        body = section.removeprefix(JSON_BLOCK)
        calls, _ = calls_in_json(body, 0, complete, self.tools)
        return calls
