"""GLM-4.5, GLM-4.6, GLM-4.7: the function name, then key/value pairs whose values are text
(typed by the tool's JSON Schema); GLM-4.7 leaves out the newlines:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
"""

from __future__ import annotations

import re

from trio_mlx.tools.schemas import arguments_text
from trio_mlx.tools.sections import PartialCall, SectionFormat

START = "<tool_call>"
END = "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GLM45Format(SectionFormat):
    name = "glm45"
    start_markers = (START,)

    def section_end(self, section: str) -> int | None:
        index = section.find(END)
        return None if index < 0 else index + len(END)

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        body = section[len(START) :]
        closed = complete or body.endswith(END)
        body = body.removesuffix(END)
        name_end = min((i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0), default=-1)
        if name_end < 0:
            if not closed:
                return []
            name_end = len(body)
        name = body[:name_end].strip()
        if not name or "<" in name or "{" in name:
            return []
        pairs = [
            (m.group(1).strip(), self.tools.typed_value(name, m.group(1).strip(), m.group(2)))
            for m in _PAIR.finditer(body, name_end)
        ]
        return [PartialCall(name, arguments_text(pairs, closed=closed))]
