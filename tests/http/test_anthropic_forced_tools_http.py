"""Anthropic `tool_choice` `any` and `{"type": "tool"}` on /v1/messages, enforced by the forced
tool-call grammar (the OpenAI routes' `required` and named function), with the official
`anthropic` client against the real server on the tiny random model: its weights know no JSON
and no tools, so every valid `tool_use` block is the grammar's."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema

from tool_fixtures import ASK, FORCED_WEATHER, anthropic_tool, function_tool, parameters_by_name
from trio_mlx.http.server import RunningServer

#: The forced tests' weather tool, and a time tool of a zone only, in the Messages shape.
TIME = function_tool(
    "get_time",
    {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)
TOOLS: Any = [anthropic_tool(FORCED_WEATHER), anthropic_tool(TIME)]
SCHEMAS = parameters_by_name([FORCED_WEATHER, TIME])
CHOICES: list[tuple[Any, set[str]]] = [
    ({"type": "any"}, {"get_weather", "get_time"}),
    ({"type": "tool", "name": "get_time"}, {"get_time"}),
    ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "get_time"}),
]


def client_of(server: RunningServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)


async def test_any_and_tool_give_schema_valid_tool_use_whole_and_streamed(
    server: RunningServer,
) -> None:
    async with client_of(server) as client:
        for choice, allowed in CHOICES:
            await one_choice(client, choice, allowed)


async def one_choice(client: anthropic.AsyncAnthropic, choice: Any, allowed: set[str]) -> None:
    """One `tool_choice`: whole and streamed, the same schema-valid calls."""
    request: Any = {
        "model": "tiny",
        "max_tokens": 400,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": choice,
        "extra_body": {"temperature": 0},
    }
    whole = await client.messages.create(**request)
    assert whole.stop_reason == "tool_use", whole
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert uses and all(b.type == "tool_use" for b in whole.content)  # no text beside
    if choice.get("disable_parallel_tool_use"):
        assert len(uses) == 1
    for block in uses:
        assert block.name in allowed and block.id.startswith("toolu_")
        jsonschema.validate(block.input, SCHEMAS[block.name])

    async with client.messages.stream(**request) as stream:
        partial: dict[int, str] = {}
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert streamed == [(b.name, b.input) for b in uses]  # greedy: the same calls
    assert [json.loads(partial[i]) for i in sorted(partial)] == [b.input for b in uses]


async def test_a_stop_sequence_inside_the_forced_call_is_no_tool_use(
    server: RunningServer,
) -> None:
    # A stop sequence met inside the call's JSON ends the answer before any call is whole: the
    # answer was `stop_reason: "tool_use"` with no tool_use block (whole) or a block of broken
    # input (streamed), and a client that trusts the stop reason looks for a call to run. Now
    # the stop reason says why it ended, and the cut call is the same block whole and streamed
    # (its input what got written whole of it: nothing).
    request: Any = {
        "model": "tiny",
        "max_tokens": 200,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_time"},
        "stop_sequences": ["zone"],  # the grammar writes it: the key of get_time's argument
        "extra_body": {"temperature": 0},
    }
    async with client_of(server) as client:
        whole = await client.messages.create(**request)
        assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "zone"), whole
        assert [(b.type, b.name, b.input) for b in whole.content] == [  # type: ignore[union-attr]
            ("tool_use", "get_time", {})
        ]
        async with client.messages.stream(**request) as stream:
            final = await stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "zone"), final
        assert blocks_of(final) == blocks_of(whole)


def blocks_of(message: Any) -> list[tuple[Any, ...]]:
    """A message's blocks without their ids: (type, text) or (type, name, input)."""
    return [
        (b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content
    ]


async def test_a_forced_call_cut_by_max_tokens_is_the_same_block_whole_and_streamed(
    server: RunningServer,
) -> None:
    # The whole answer dropped a call that max_tokens cut (`content: []`) while the stream had
    # sent it: now both end with it, as Anthropic's answers do, its input the keys it got whole
    # (what the client's stream accumulator reads from the same `partial_json`).
    request: Any = {
        "model": "tiny",
        "messages": ASK,
        "tools": [anthropic_tool(FORCED_WEATHER)],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "extra_body": {"temperature": 0},
    }

    async def streamed(limit: int) -> tuple[Any, str]:
        """The streamed answer, and its call's `partial_json` pieces joined."""
        async with client_of(server) as client:
            async with client.messages.stream(max_tokens=limit, **request) as stream:
                partial = ""
                async for event in stream:
                    if (
                        event.type == "content_block_delta"
                        and event.delta.type == "input_json_delta"
                    ):
                        partial += event.delta.partial_json
                return await stream.get_final_message(), partial

    async with client_of(server) as client:
        full, arguments = await streamed(400)
        assert full.stop_reason == "tool_use" and full.usage is not None
        [call] = full.content
        assert call.type == "tool_use" and json.loads(arguments) == call.input
        cuts: dict[str, int] = {}
        for limit in range(1, full.usage.output_tokens):
            whole = await client.messages.create(max_tokens=limit, **request)
            assert whole.stop_reason == "max_tokens", (limit, whole)
            final, partial = await streamed(limit)
            assert final.stop_reason == "max_tokens"
            assert blocks_of(final) == blocks_of(whole), limit
            # (a cut inside a character ends it with U+FFFD)
            assert arguments.startswith(partial.removesuffix("\ufffd"))
            if blocks_of(whole) == [("text", "")]:  # cut before the call's name was written
                cuts["before the call"] = limit
                continue
            [block] = whole.content
            assert block.type == "tool_use" and block.name == "get_weather"
            # What it holds is the complete call's, key for key: nothing made up.
            assert {k: call.input[k] for k in block.input} == block.input  # type: ignore[index]
            cuts["some keys whole" if block.input else "no key whole"] = limit
    assert set(cuts) == {"before the call", "no key whole", "some keys whole"}, cuts
