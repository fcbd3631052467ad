"""Kimi K2 (and K2 Thinking, K2.5): a section of calls, each with an id `functions.NAME:INDEX`
and its JSON arguments; the id is kept as the call's id (the template renders it back):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(wrapped here: no newline before `<|tool_call_argument_begin|>` in the model's text).
"""

from __future__ import annotations

from trio_mlx.tools.markup import stable_prefix
from trio_mlx.tools.sections import PartialCall, SectionFormat

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"


class KimiK2Format(SectionFormat):
    name = "kimi_k2"
    start_markers = SECTION_BEGIN

    def section_end(self, section: str) -> int | None:
        for end in SECTION_END:
            index = section.find(end)
            if index >= 0:
                return index + len(end)
        return None

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        calls = []
        for piece in section.split(CALL_BEGIN)[1:]:
            closed = complete or CALL_END in piece
            piece = piece.split(CALL_END, 1)[0]
            for end in SECTION_END:
                piece = piece.split(end, 1)[0]
            if ARGUMENT_BEGIN not in piece:
                break
            call_id, arguments = piece.split(ARGUMENT_BEGIN, 1)
            call_id = call_id.strip()
            name = call_id.removeprefix("functions.")
            if ":" in name:
                name = name.rsplit(":", 1)[0]
            if not name:
                continue
            if closed:
                arguments = arguments.strip()
            else:
                arguments = stable_prefix(arguments, (CALL_END, *SECTION_END)).lstrip()
            calls.append(PartialCall(name, arguments, call_id or None))
            if not closed:
                break
        return calls
