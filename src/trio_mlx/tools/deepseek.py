"""DeepSeek V3, R1 (and V3.1, V3.2's chat format): calls between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`. V3 and R1 write the type, the name and a fenced JSON block; V3.1 writes
the name and the JSON alone (wrapped here; the model writes it on one line):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
    {"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from trio_mlx.tools.markup import stable_prefix
from trio_mlx.tools.sections import PartialCall, SectionFormat

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE_OPEN = "```json"
_FENCE_CLOSE = "```"


class DeepSeekFormat(SectionFormat):
    name = "deepseek_v3"
    start_markers = (CALLS_BEGIN,)

    def section_end(self, section: str) -> int | None:
        index = section.find(CALLS_END)
        return None if index < 0 else index + len(CALLS_END)

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        calls = []
        pieces = section.split(CALL_BEGIN)[1:]
        for n, piece in enumerate(pieces):
            closed = complete or CALL_END in piece
            piece = piece.split(CALL_END, 1)[0].split(CALLS_END, 1)[0]
            if SEP not in piece:
                continue
            head, rest = piece.split(SEP, 1)
            if head.strip() == "function":  # V3 / R1: name, newline, fenced JSON
                if "\n" not in rest and not closed:
                    break
                name, _, arguments = rest.partition("\n")
                arguments = arguments.strip()
                if not closed and _FENCE_OPEN.startswith(arguments):
                    arguments = ""  # the fence may still be opening
                if arguments.startswith(_FENCE_OPEN):
                    arguments = arguments[len(_FENCE_OPEN) :]
                arguments = arguments.split(_FENCE_CLOSE, 1)[0]
                if closed:
                    arguments = arguments.strip()
                else:
                    arguments = stable_prefix(arguments, (_FENCE_CLOSE, CALL_END)).lstrip()
            else:
                name = head
                settled = stable_prefix(rest, (CALL_END,))
                arguments = rest.strip() if closed else settled.lstrip()
            name = name.strip()
            if name:
                calls.append(PartialCall(name, arguments))
            if not closed and n < len(pieces) - 1:
                break
        return calls
