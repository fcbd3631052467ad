"""Shared fixtures of the function-calling tests: the tools they offer (one definition, given in
each API's shape), the check of a forced call against its tool's parameters, and a server whose
model writes scripted replies.

Three tool sets, for three kinds of test:
- `TOOLS`: offered under `tool_choice` "auto" to a scripted model (its calls are the script's).
- `FORCED_TOOLS`: forced on the tiny random model, whose every valid call is the grammar's; the
  bounded strings and enums keep a call short enough to close within the tests' token budgets.
- `BUNDLED_TOOLS`: forced on the real bundled SmolLM2, which writes a city of its own choosing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai

from model_wrappers import ScriptedReplies, wrapping_loader
from servers import running_server
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.http.server import RunningServer


def function_tool(
    name: str, parameters: dict[str, Any], description: str | None = None
) -> dict[str, Any]:
    """A tool in the Chat Completions shape: `{"type": "function", "function": {...}}`."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def responses_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


def anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions tool in the Anthropic Messages shape (`input_schema`)."""
    function = tool["function"]
    shaped = {"name": function["name"]}
    if "description" in function:
        shaped["description"] = function["description"]
    return {**shaped, "input_schema": function["parameters"]}


def parameters_by_name(tools: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Each Chat Completions tool's parameters schema, by function name."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


def weather_parameters(city_max_length: int) -> dict[str, Any]:
    """A city (a bounded string) and a unit, both required, nothing else."""
    return {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": city_max_length},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }


ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]

WEATHER = function_tool(
    "get_weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "The current weather in a city",
)
TIME = function_tool("get_time", {"type": "object"})
TOOLS: Any = [WEATHER, TIME]
#: The scripted calls of `WEATHER` and `TIME`, in the Hermes markup the fallback prompt asks for.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

FORCED_WEATHER = function_tool(
    "get_weather", weather_parameters(12), "The current weather in a city"
)
FORCED_TIME = function_tool(
    "get_time",
    {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}, "hour24": {"type": "boolean"}},
        "required": ["zone", "hour24"],
        "additionalProperties": False,
    },
)
FORCED_TOOLS: Any = [FORCED_WEATHER, FORCED_TIME]

BUNDLED_TOOLS: Any = [
    function_tool("get_weather", weather_parameters(40), "The current weather in a city."),
    function_tool(
        "get_time",
        {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
        "The current time in a time zone.",
    ),
]
BUNDLED_ASK: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_calls(
    calls: list[tuple[str, str]], allowed: set[str], parallel: bool, parameters: dict[str, Any]
) -> None:
    """Calls given as (name, arguments JSON): at least one, one only without `parallel`, each
    of an allowed function with arguments valid against its schema in `parameters` (by name)."""
    assert calls
    assert parallel or len(calls) == 1
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), parameters[name])


async def leave_mid_arguments(
    http: httpx.AsyncClient, body: dict[str, Any], pieces: int = 3
) -> None:
    """Stream the chat completion `body` and go away (close the response) once `pieces` chunks
    carrying a call's arguments have come: the call has started and its arguments are
    streaming. Fails if the stream ends before that."""
    seen = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"arguments":"' in line:
                seen += 1
                if seen == pieces:
                    break
    assert seen == pieces, f"the stream ended after {seen} argument chunks"


class Scripted:
    """A server whose model writes the scripts it is given, one per request."""

    def __init__(self, server: RunningServer, model: ScriptedReplies) -> None:
        self.server = server
        self.model = model
        engine = server.state.engine
        assert engine is not None
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def will_reply(self, *texts: str) -> None:
        eos = self.tokenizer.eos_token_id
        self.model.replies = [
            [*self.tokenizer.encode(text, add_special_tokens=False), eos] for text in texts
        ]

    def prompt(self, n: int = -1) -> str:
        return str(self.tokenizer.decode(self.model.prompts[n]))

    def openai_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.server.url + "/v1", api_key="unused", max_retries=0, timeout=30
        )

    def anthropic_client(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(
            base_url=self.server.url, api_key="unused", max_retries=0, timeout=30
        )


def declare_think_tags(loaded: LoadedModel) -> None:
    """Make the loaded tokenizer declare `<think>` / `</think>` as its thinking tags."""
    tokenizer = loaded.tokenizer
    tokenizer._think_start, tokenizer._think_end = "<think>", "</think>"
    tokenizer._think_start_tokens = tuple(tokenizer.encode("<think>", add_special_tokens=False))
    tokenizer._think_end_tokens = tuple(tokenizer.encode("</think>", add_special_tokens=False))


@asynccontextmanager
async def scripted_server(model_dir: Path, *, think_tags: bool = False) -> AsyncIterator[Scripted]:
    """A server on the tiny model wrapped in `ScriptedReplies`, run as that wrapper requires
    (one sequence at a time, no fused tail, no prefix cache, one-chunk prefills), serving it
    as "tiny"; with `think_tags`, its tokenizer declares `<think>` tags."""
    if think_tags:
        made: list[ScriptedReplies] = []

        def loader(spec: str | Path | None) -> LoadedModel:
            loaded = load_model(spec)
            declare_think_tags(loaded)
            made.append(ScriptedReplies(loaded.model))
            return dataclasses.replace(loaded, model=made[0])

    else:
        loader, made = wrapping_loader(ScriptedReplies)
    async with running_server(
        model_dir,
        loader=loader,
        served_model_names=("tiny",),
        max_num_seqs=1,
        fused_tail_tokens=1,
        cache_memory_bytes=0,
        prefill_chunk_seconds=30.0,
    ) as server:
        made[0].armed = True  # the load-time probes are over
        yield Scripted(server, made[0])
