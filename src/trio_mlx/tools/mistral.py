"""Mistral: `[TOOL_CALLS]` and then, before tokenizer v11, a JSON list of calls; from v11
(Mistral Small 3.2, Magistral, Devstral) one `name[ARGS]{json}` per `[TOOL_CALLS]` (some write a
`[CALL_ID]id` between the name and `[ARGS]`):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
"""

from __future__ import annotations

from trio_mlx.tools.json_calls import calls_in_json
from trio_mlx.tools.markup import stable_prefix
from trio_mlx.tools.sections import PartialCall, SectionFormat

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralFormat(SectionFormat):
    name = "mistral"
    start_markers = (TOOL_CALLS,)

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        body = section[len(TOOL_CALLS) :]
        head = body.lstrip()
        if head.startswith(("[", "{")):
            calls, _ = calls_in_json(head, 0, complete)
            return calls
        calls = []
        pieces = body.split(TOOL_CALLS)
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            if ARGS not in piece:
                if last and not complete:
                    break
                continue
            head, arguments = piece.split(ARGS, 1)
            call_id = None
            if CALL_ID in head:
                head, call_id = head.split(CALL_ID, 1)
                call_id = call_id.strip() or None
            name = head.strip()
            if not name:
                continue
            settled = (
                arguments.strip()
                if complete or not last
                else stable_prefix(arguments, (TOOL_CALLS,)).lstrip()
            )
            calls.append(PartialCall(name, settled, call_id))
        return calls
