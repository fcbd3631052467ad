"""Reading a raw SSE body the way a strict client would."""

from __future__ import annotations

import json
from typing import Any


def data_lines(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order; every event must end with a blank line."""
    assert body.endswith("\n\n"), "an SSE body ends with a blank line"
    payloads = []
    for event in body.split("\n\n")[:-1]:
        lines = [line for line in event.split("\n") if not line.startswith(":")]
        data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert len(data) == 1, f"one data line per event: {event!r}"
        payloads.append(data[0])
    return payloads


def chunks(body: str) -> list[dict[str, Any]]:
    """The JSON chunks of an OpenAI stream, checking that `[DONE]` comes once, last."""
    payloads = data_lines(body)
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]


def named_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """`(event name, data)` pairs of a Responses API stream (`event:` + `data:` lines)."""
    out = []
    for event in body.split("\n\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in event.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out
