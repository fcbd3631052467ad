"""Llama 3.1, 3.2, 3.3 (and Llama 4's JSON mode): the whole reply is the call, as JSON (what
the templates ask for), optionally after `<|python_tag|>`; Llama 3.2 joins parallel calls with
`;`. Built-in tools after `<|python_tag|>` are Python calls (`brave_search.call(query="x")`):

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

A reply that starts with JSON naming no offered tool is content, as is any other reply."""

from __future__ import annotations

from trio_mlx.tools.json_calls import calls_in_json
from trio_mlx.tools.pythonic import pythonic_calls
from trio_mlx.tools.sections import PartialCall, SectionFormat

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(SectionFormat):
    name = "llama3_json"
    start_markers = (PYTHON_TAG,)
    leading_markers = ("{",)

    def scan(self, section: str, complete: bool) -> list[PartialCall]:
        tagged = section.startswith(PYTHON_TAG)
        body = section[len(PYTHON_TAG) :] if tagged else section
        calls, _ = calls_in_json(body, 0, complete, self.tools, separators=" \t\r\n;,")
        if not calls and tagged and complete:
            return pythonic_calls(body, strip_call_suffix=True)
        return calls
