"""Reading a forced tool call while it is generated: the JSON that `tool_choice` "required" or a
named function makes the model write (`trio_mlx.structured.tool_choice`), as tool events.

Under that grammar the whole reply is one call object, `{"name": "get_weather", "arguments":
{"city": "Paris"}}`, or (parallel calls) a non-empty array of them. `ForcedCallStream` reports
a call as soon as its name is complete (`CallStarted`) and then its arguments, the raw JSON text
the model wrote, in pieces as they grow (`ArgumentsAppended`); nothing is ever `Content`. A call
is *complete* once its object's closing brace has arrived: `complete` counts those, so that a
reply cut short (by `max_tokens`) can be told from a finished one, and a whole-text reader can
leave the cut call out.
"""

from __future__ import annotations

from trio_mlx.tools.calls import new_call_id
from trio_mlx.tools.events import ArgumentsAppended, CallStarted, ToolEvent
from trio_mlx.tools.format import ToolCallStream
from trio_mlx.tools.json_calls import call_in_object

#: What may stand between the calls (and before the first): the array's brackets and commas.
_BETWEEN = " \t\r\n[,]"


class ForcedCallStream(ToolCallStream):
    """The incremental reader of one reply generated under the forced tool-call grammar."""

    def __init__(self) -> None:
        self._text = ""
        #: Where the object being read starts (None: between objects), and where to look next.
        self._object: int | None = None
        self._at = 0
        #: The call being read: its id and the arguments text sent so far (None: not started).
        self._open: tuple[str, str] | None = None
        #: Calls started, and calls whose object is closed.
        self.started = 0
        self.complete = 0

    def feed(self, text: str) -> list[ToolEvent]:
        self._text += text
        events: list[ToolEvent] = []
        while True:
            if self._object is None:
                while self._at < len(self._text) and self._text[self._at] in _BETWEEN:
                    self._at += 1
                if self._at >= len(self._text) or self._text[self._at] != "{":
                    return events  # more to come (the grammar allows nothing else here)
                self._object = self._at
            call, end = call_in_object(self._text, self._object, False)
            if call is not None:
                if self._open is None:
                    self._open = (new_call_id(), "")
                    events.append(CallStarted(self.started, self._open[0], call.name))
                    self.started += 1
                call_id, sent = self._open
                if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                    events.append(ArgumentsAppended(self.started - 1, call.arguments[len(sent) :]))
                    self._open = (call_id, call.arguments)
            if end is None:
                return events
            if self._open is not None:
                if not self._open[1]:  # no arguments written: the grammar requires them
                    events.append(ArgumentsAppended(self.started - 1, "{}"))
                self.complete += 1
            self._object, self._open, self._at = None, None, end

    def finish(self) -> list[ToolEvent]:
        """Nothing is held back: a call still open at the end stays incomplete."""
        return []
