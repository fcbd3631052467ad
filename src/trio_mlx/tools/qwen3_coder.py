"""Qwen3-Coder (and Qwen3-Coder-Next, Qwen3.5): XML-like calls whose values are plain text,
typed by the tool's JSON Schema:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import re

from trio_mlx.tools.schemas import arguments_text
from trio_mlx.tools.sections import PartialCall, SectionFormat

START = "<tool_call>"
END = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = "</function>"


class Qwen3CoderFormat(SectionFormat):
    name = "qwen3_coder"
    start_markers = (START, "<function=")

    def section_end(self, section: str) -> int | None:
        end = END if section.startswith(START) else _FUNCTION_END
        index = section.find(end)
        return None if index < 0 else index + len(end)

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        calls = []
        functions = list(_FUNCTION.finditer(section))
        for n, match in enumerate(functions):
            name = match.group(1).strip()
            stop = functions[n + 1].start() if n + 1 < len(functions) else len(section)
            body = section[match.end() : stop]
            closed = complete or _FUNCTION_END in body
            body = body.split(_FUNCTION_END, 1)[0]
            pairs = []
            for parameter in _PARAMETER.finditer(body):
                key = parameter.group(1).strip()
                raw = _strip_one_newline(parameter.group(2))
                pairs.append((key, self.tools.typed_value(name, key, raw)))
            calls.append(PartialCall(name, arguments_text(pairs, closed=closed)))
        return calls


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
