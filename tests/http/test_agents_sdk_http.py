"""The OpenAI Agents SDK (`openai-agents`), the most common thing built on the openai client,
driving the real server: agents over Chat Completions, the Responses API and its WebSocket mode;
function tools called and their results fed back, handoffs, structured output, streamed runs,
sessions (`OpenAIConversationsSession` on /v1/conversations, `conversation_id`,
`previous_response_id`), runs cancelled mid-way.

Three servers on the tiny model:
- `server`, its random weights as they are. They know no JSON and no tools: calls and
  structured output are the grammar's, forced by `tool_choice="required"` and the json_schema
  format the SDK sends, over schemas bounded (enums, short strings) so that a call or an object
  closes within the token budgets. Its text never ends on its own (it runs to `max_tokens`).
- `scripted`, the same model writing the replies a test scripts (`tool_fixtures.Scripted`):
  text that ends, a call in the Hermes markup under `tool_choice` "auto", and the prompts each
  request rendered, to see what the SDK sent back.
- `gated`, the model held at a gate the test closes, to cancel a run while its request is in
  flight.

The SDK is asyncio's; the server runs in the test's Trio run. Each agent run goes to a worker
thread with an event loop of its own (`asyncio.run`) and an openai client made there. Tracing
is off (it would export to api.openai.com).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import agents
import jsonschema
import openai
import pydantic
import pytest
import trio
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIConversationsSession,
    OpenAIProvider,
    OpenAIResponsesModel,
    OpenAIResponsesWSModel,
    RunConfig,
    Runner,
    function_tool,
)
from agents.stream_events import RawResponsesStreamEvent

from idle import wait_until_idle
from model_wrappers import GatedModel, wrapping_loader
from servers import eventually, running_server
from tool_fixtures import CALL, Scripted, scripted_server
from trio_mlx.actors.engine import Engine
from trio_mlx.http.server import RunningServer

T = TypeVar("T")
#: Chat Completions, the Responses API over HTTP and over its WebSocket mode.
API = ["chat", "responses", "websocket"]
#: Greedy and short: the random model's text runs to its token limit.
GREEDY = ModelSettings(temperature=0, max_tokens=8)
#: Greedy with room for a forced call or a schema's object to close.
ROOMY = ModelSettings(temperature=0, max_tokens=300)
#: How long one agent run (all of its model calls) may take.
RUN_LIMIT = 60.0

agents.set_tracing_disabled(True)


#: The models `model_for` made for each client (by `id`), closed with it by `in_asyncio`: the
#: WebSocket model keeps its connection open between turns.
_made: dict[int, list[agents.Model]] = {}


async def in_asyncio(
    server: RunningServer, work: Callable[[openai.AsyncOpenAI], Awaitable[T]]
) -> T:
    """`work(client)` on an asyncio loop of its own in a worker thread, with an openai client
    for `server` made (and closed, with the models made for it) on that loop; bounded by
    `RUN_LIMIT`."""

    async def main() -> T:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30
        ) as client:
            _made[id(client)] = []
            try:
                return await asyncio.wait_for(work(client), RUN_LIMIT)
            finally:
                for model in _made.pop(id(client)):
                    await model.close()

    return await trio.to_thread.run_sync(asyncio.run, main())


def model_for(api: str, client: openai.AsyncOpenAI) -> agents.Model:
    model: agents.Model
    if api == "chat":
        model = OpenAIChatCompletionsModel(model="tiny", openai_client=client)
    elif api == "websocket":
        model = OpenAIResponsesWSModel(model="tiny", openai_client=client)
    else:
        model = OpenAIResponsesModel(model="tiny", openai_client=client)
    _made[id(client)].append(model)
    return model


async def idle(server: RunningServer) -> None:
    assert server.state.engine is not None
    await wait_until_idle(server.state.engine)


async def run_agent(agent: Agent[Any], ask: str, stream: bool) -> agents.RunResultBase:
    """`Runner.run`, or `Runner.run_streamed` with its events read to the end."""
    if not stream:
        return await Runner.run(agent, ask)
    result = Runner.run_streamed(agent, ask)
    async for _ in result.stream_events():
        pass
    assert result.is_complete
    return result


@pytest.fixture
async def scripted(tiny_model_dir: Path) -> AsyncIterator[Scripted]:
    async with scripted_server(tiny_model_dir) as scripted:
        yield scripted


# ---- plain text ------------------------------------------------------------------------------


async def test_plain_text_over_chat_completions_on_the_random_model(
    server: RunningServer,
) -> None:
    async def work(client: openai.AsyncOpenAI) -> agents.RunResult:
        agent = Agent(
            name="terse",
            instructions="You are terse.",
            model=model_for("chat", client),
            model_settings=GREEDY,
        )
        return await Runner.run(agent, "Name a colour.")

    result = await in_asyncio(server, work)
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 1
    usage = result.context_wrapper.usage
    assert usage.requests == 1 and usage.input_tokens > 0 and usage.output_tokens == 8
    await idle(server)


@pytest.mark.parametrize("api", ["responses", "websocket"])
async def test_a_reply_cut_by_its_token_limit_is_an_error_on_the_responses_api(
    server: RunningServer, api: str
) -> None:
    """The SDK takes a response that ends `incomplete` as a failed turn (as it does from
    OpenAI); the server says why: its token limit."""

    async def work(client: openai.AsyncOpenAI) -> None:
        agent = Agent(name="a", model=model_for(api, client), model_settings=GREEDY)
        await Runner.run(agent, "Name a colour.")

    with pytest.raises(agents.ModelBehaviorError, match="max_output_tokens"):
        await in_asyncio(server, work)
    await idle(server)


@pytest.mark.parametrize("api", API)
async def test_plain_text_that_ends(scripted: Scripted, api: str) -> None:
    scripted.will_reply("Blue.")

    async def work(client: openai.AsyncOpenAI) -> agents.RunResult:
        agent = Agent(
            name="terse",
            instructions="You are terse.",
            model=model_for(api, client),
            model_settings=ModelSettings(temperature=0, max_tokens=20),
        )
        return await Runner.run(agent, "Name a colour.")

    result = await in_asyncio(scripted.server, work)
    assert result.final_output == "Blue."
    prompt = scripted.prompt()
    assert "You are terse." in prompt and "Name a colour." in prompt
    await idle(scripted.server)


@pytest.mark.parametrize("api", API)
async def test_a_model_named_through_a_provider(scripted: Scripted, api: str) -> None:
    """The other common set-up: the agent names its model ("tiny") and the run's
    `OpenAIProvider` makes it. (Given the client rather than a base URL: the client the
    provider would make shares the SDK's one process-wide HTTP client, which is bound to the
    first event loop, and each test runs its own.)"""
    scripted.will_reply("Blue.")

    async def work(client: openai.AsyncOpenAI) -> Any:
        provider = OpenAIProvider(
            openai_client=client,
            use_responses=api != "chat",
            use_responses_websocket=api == "websocket",
        )
        agent = Agent(
            name="terse",
            instructions="You are terse.",
            model="tiny",
            model_settings=ModelSettings(temperature=0, max_tokens=20),
        )
        try:
            result = await Runner.run(
                agent, "Name a colour.", run_config=RunConfig(model_provider=provider)
            )
        finally:
            await provider.aclose()
        return result.final_output

    assert await in_asyncio(scripted.server, work) == "Blue."
    await idle(scripted.server)


# ---- function tools --------------------------------------------------------------------------


class Calls:
    """Function tools that note each call's arguments."""

    def __init__(self) -> None:
        self.made: list[tuple[str, dict[str, Any]]] = []

    def tools(self) -> list[agents.Tool]:
        @function_tool
        def get_time(zone: Literal["UTC", "CET", "PST"], hour24: bool) -> str:
            """The current time in a time zone.

            Args:
                zone: The time zone.
                hour24: Whether to give the time on a 24-hour clock.
            """
            self.made.append(("get_time", {"zone": zone, "hour24": hour24}))
            return f"12:00 {zone}"

        @function_tool
        def get_weather(city: Annotated[str, pydantic.Field(max_length=12)]) -> str:
            """The current weather in a city.

            Args:
                city: The city's name.
            """
            self.made.append(("get_weather", {"city": city}))
            return f"sunny in {city}"

        return [get_time, get_weather]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", API)
async def test_a_forced_call_runs_the_tool_and_its_result_ends_the_run(
    server: RunningServer, api: str, stream: bool
) -> None:
    calls = Calls()
    tools = calls.tools()
    schemas = {tool.name: tool.params_json_schema for tool in tools}  # type: ignore[union-attr]

    async def work(client: openai.AsyncOpenAI) -> agents.RunResultBase:
        agent = Agent(
            name="clock",
            instructions="Use the tools.",
            model=model_for(api, client),
            model_settings=ROOMY.resolve(
                ModelSettings(tool_choice="required", parallel_tool_calls=False)
            ),
            tools=tools,
            tool_use_behavior="stop_on_first_tool",
        )
        return await run_agent(agent, "What time is it in Paris?", stream)

    result = await in_asyncio(server, work)
    assert len(calls.made) == 1  # one call (no parallel calls), run once
    name, arguments = calls.made[0]
    jsonschema.validate(arguments, schemas[name])
    called = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(called) == 1 and len(outputs) == 1
    raw = called[0].raw_item  # the SDK's own Responses-shaped item, from either API
    assert raw.type == "function_call" and raw.name == name
    assert json.loads(raw.arguments) == arguments
    assert result.final_output == outputs[0].output  # the tool's result ends the run
    await idle(server)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", API)
async def test_a_call_its_result_fed_back_and_the_final_answer(
    scripted: Scripted, api: str, stream: bool
) -> None:
    """The model chooses a call (tool_choice "auto"), the SDK runs the tool and sends its result
    back, the model answers from it: the whole agent loop, two requests."""
    scripted.will_reply(CALL, "It is sunny in Paris.")  # get_weather(city="Paris")
    calls = Calls()

    async def work(client: openai.AsyncOpenAI) -> agents.RunResultBase:
        agent = Agent(
            name="weather",
            instructions="Use the tools.",
            model=model_for(api, client),
            model_settings=ModelSettings(temperature=0, max_tokens=60),
            tools=calls.tools(),
        )
        return await run_agent(agent, "What is the weather in Paris?", stream)

    result = await in_asyncio(scripted.server, work)
    assert calls.made == [("get_weather", {"city": "Paris"})]
    assert result.final_output == "It is sunny in Paris."
    assert len(result.raw_responses) == 2
    assert [item.type for item in result.new_items] == [
        "tool_call_item",
        "tool_call_output_item",
        "message_output_item",
    ]
    # The second request's prompt holds the call and the tool's result.
    second = scripted.prompt()
    assert "get_weather" in second and "sunny in Paris" in second
    assert second.count("What is the weather in Paris?") == 1
    await idle(scripted.server)


# ---- structured output -----------------------------------------------------------------------


class City(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=12)]
    kind: Literal["capital", "port", "town"]
    coastal: bool


def city_agent(api: str, client: openai.AsyncOpenAI) -> Agent[Any]:
    return Agent(
        name="cities",
        instructions="Describe the city.",
        model=model_for(api, client),
        model_settings=ROOMY,
        output_type=City,
    )


@pytest.mark.parametrize("api", API)
async def test_structured_output_parses_into_the_output_type(
    server: RunningServer, api: str
) -> None:
    async def work(client: openai.AsyncOpenAI) -> agents.RunResult:
        return await Runner.run(city_agent(api, client), "Describe Paris.")

    result = await in_asyncio(server, work)
    city = result.final_output
    assert isinstance(city, City)
    assert len(city.name) <= 12
    await idle(server)


@pytest.mark.parametrize("parallel", [False, True], ids=["one-call", "parallel"])
@pytest.mark.parametrize("api", API)
async def test_forced_calls_fed_back_then_a_structured_answer(
    server: RunningServer, api: str, parallel: bool
) -> None:
    """The full loop on the random model: `tool_choice="required"` forces the first turn's
    call(s), the SDK runs them and sends the results back with `tool_choice` reset to auto, and
    the second turn's answer is the output type's object (the json_schema format ends it).
    Streamed, greedy, the same calls, answer and usage."""
    calls = Calls()
    tools = calls.tools()
    schemas = {tool.name: tool.params_json_schema for tool in tools}  # type: ignore[union-attr]

    async def work(client: openai.AsyncOpenAI) -> list[agents.RunResultBase]:
        agent = Agent(
            name="clock",
            instructions="Use the tools, then describe the city.",
            model=model_for(api, client),
            model_settings=ROOMY.resolve(
                ModelSettings(
                    tool_choice="required", parallel_tool_calls=parallel, include_usage=True
                )
            ),
            tools=tools,
            output_type=City,
        )
        return [await run_agent(agent, "Describe Paris.", stream) for stream in (False, True)]

    result, streamed = await in_asyncio(server, work)
    assert isinstance(result.final_output, City)
    assert len(result.raw_responses) == 2
    kinds = [item.type for item in result.new_items]
    count = kinds.count("tool_call_item")
    assert count >= 1 and (parallel or count == 1)
    assert kinds == ["tool_call_item"] * count + ["tool_call_output_item"] * count + [
        "message_output_item"
    ]
    assert calls.made[:count] == calls.made[count:]  # the streamed run's calls: the same
    raw_calls = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    for (name, arguments), raw in zip(calls.made[:count], raw_calls, strict=True):
        jsonschema.validate(arguments, schemas[name])
        assert raw.name == name and json.loads(raw.arguments) == arguments

    assert streamed.final_output == result.final_output
    assert [item.type for item in streamed.new_items] == kinds
    usage, whole_usage = streamed.context_wrapper.usage, result.context_wrapper.usage
    assert (usage.requests, usage.input_tokens, usage.output_tokens) == (
        2,
        whole_usage.input_tokens,
        whole_usage.output_tokens,
    )
    await idle(server)


# ---- streamed runs ---------------------------------------------------------------------------


async def streamed(agent: Agent[Any], ask: str) -> tuple[agents.RunResultStreaming, list[Any]]:
    """`Runner.run_streamed` to its end: the result and the raw model events."""
    result = Runner.run_streamed(agent, ask)
    raw = [
        event.data
        async for event in result.stream_events()
        if isinstance(event, RawResponsesStreamEvent)
    ]
    assert result.is_complete
    return result, raw


@pytest.mark.parametrize(
    ("api", "output"),
    [("chat", "text"), *((api, "structured") for api in API)],
)
async def test_a_streamed_run_ends_as_the_whole_one(
    server: RunningServer, api: str, output: str
) -> None:
    """Greedy, a streamed run's final output and usage are the non-streamed run's, its text
    deltas adding up to the output. (Plain text over Chat Completions only: the random model's
    text runs to its token limit, which a Responses run takes for a failure.)"""

    def agent_for(client: openai.AsyncOpenAI) -> Agent[Any]:
        return Agent(
            name="cities",
            model=model_for(api, client),
            # The SDK asks for streamed usage by itself only from api.openai.com.
            model_settings=(GREEDY if output == "text" else ROOMY).resolve(
                ModelSettings(include_usage=True)
            ),
            output_type=City if output == "structured" else None,
        )

    async def work(client: openai.AsyncOpenAI) -> tuple[Any, Any, list[Any]]:
        whole = await Runner.run(agent_for(client), "Describe Paris.")
        result, raw = await streamed(agent_for(client), "Describe Paris.")
        return whole, result, raw

    whole, result, raw = await in_asyncio(server, work)
    assert result.final_output == whole.final_output
    if output == "structured":
        assert isinstance(result.final_output, City)
    usage, whole_usage = result.context_wrapper.usage, whole.context_wrapper.usage
    assert (usage.requests, usage.input_tokens, usage.output_tokens) == (
        whole_usage.requests,
        whole_usage.input_tokens,
        whole_usage.output_tokens,
    )
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    kinds = [event.type for event in raw]
    deltas = [event.delta for event in raw if event.type == "response.output_text.delta"]
    assert len(deltas) > 1  # the SDK's Chat Completions model gives the same Responses events
    text = "".join(deltas)
    assert (text if output == "text" else City.model_validate_json(text)) == whole.final_output
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    await idle(server)


# ---- cancellation ----------------------------------------------------------------------------
# On a server whose model waits at a gate the test closes, so that the client goes away while
# its request is surely in flight: with the model free, the tiny model outruns the SDK's reading
# of a WebSocket's events, and a run cancelled mid-way may have been sent all of them already.


@dataclasses.dataclass
class Gated:
    server: RunningServer
    model: GatedModel

    @property
    def engine(self) -> Engine:
        assert self.server.state.engine is not None
        return self.server.state.engine


@pytest.fixture
async def gated(tiny_model_dir: Path) -> AsyncIterator[Gated]:
    loader, made = wrapping_loader(GatedModel)
    async with running_server(tiny_model_dir, loader=loader, served_model_names=("tiny",)) as srv:
        yield Gated(srv, made[0])


#: A run that would go on long after the test has gone.
LONG = ModelSettings(temperature=0, max_tokens=900)


async def aborted_and_serving(gated: Gated, before: dict[str, Any]) -> None:
    """Once the client has gone (nothing in flight on the Trio side), the gate opens: the
    request is aborted at the runner's next step boundary, long before its token limit; the
    engine is idle and serves the next run."""
    engine = gated.engine
    await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 0)
    gated.model.gate.set()
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before["aborted"] + 1
    assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 100

    async def again(client: openai.AsyncOpenAI) -> agents.RunResult:
        agent = Agent(name="terse", model=model_for("chat", client), model_settings=GREEDY)
        return await Runner.run(agent, "Name a colour.")

    assert (await in_asyncio(gated.server, again)).final_output
    await wait_until_idle(engine)


@pytest.mark.parametrize("api", API)
async def test_a_streamed_run_cancelled_mid_way_is_aborted_and_the_server_goes_on(
    gated: Gated, api: str
) -> None:
    """`result.cancel()` after a few text deltas: the SDK leaves the stream, the server aborts
    the request."""
    before = gated.engine.get_stats()["runner"]

    async def work(client: openai.AsyncOpenAI) -> int:
        agent = Agent(name="talker", model=model_for(api, client), model_settings=LONG)
        result = Runner.run_streamed(agent, "Tell me a long story.")
        deltas = 0
        async for event in result.stream_events():
            if isinstance(event, RawResponsesStreamEvent) and event.data.type.endswith(".delta"):
                deltas += 1
                if deltas == 3:
                    gated.model.gate.clear()  # the runner stops at its next forward pass
                    result.cancel()
        assert result.is_complete
        return deltas

    assert await in_asyncio(gated.server, work) >= 3
    await aborted_and_serving(gated, before)


@pytest.mark.parametrize("api", API)
async def test_a_run_whose_task_is_cancelled_mid_request_is_aborted(gated: Gated, api: str) -> None:
    """`Runner.run` (not streamed) in an asyncio task cancelled while the model works on its
    request: the client drops the exchange, the server aborts the request."""
    before = gated.engine.get_stats()["runner"]
    held = gated.model.held
    held.clear()
    gated.model.gate.clear()

    async def work(client: openai.AsyncOpenAI) -> None:
        agent = Agent(name="talker", model=model_for(api, client), model_settings=LONG)
        run = asyncio.create_task(Runner.run(agent, "Tell me a long story."))
        assert await asyncio.to_thread(held.wait, 10.0), "the request never reached the model"
        assert not run.done()
        # Cancelled again until it ends: Python 3.11's `asyncio.wait_for`, around each of the
        # WebSocket model's receives, swallows a cancellation that comes with a frame (fixed in
        # 3.12); the run would then wait for the next frame, which the gate holds back.
        while not run.done():
            run.cancel()
            await asyncio.wait({run}, timeout=0.1)
        assert run.cancelled()

    await in_asyncio(gated.server, work)
    await aborted_and_serving(gated, before)


# ---- sessions --------------------------------------------------------------------------------

FIRST, SECOND = "Name a colour.", "And another one?"


def chatty(api: str, client: openai.AsyncOpenAI) -> Agent[Any]:
    return Agent(
        name="terse",
        instructions="You are terse.",
        model=model_for(api, client),
        model_settings=ModelSettings(temperature=0, max_tokens=20),
    )


def second_turn_saw_the_first(scripted: Scripted) -> None:
    """The last prompt holds the first turn, its answer and the second ask, once each, in
    order, under the instructions."""
    prompt = scripted.prompt()
    assert prompt.count("You are terse.") == 1
    assert [prompt.count(text) for text in (FIRST, "Blue.", SECOND)] == [1, 1, 1]
    assert prompt.index(FIRST) < prompt.index("Blue.") < prompt.index(SECOND)


@pytest.mark.parametrize("api", API)
async def test_an_openai_conversations_session_keeps_the_history(
    scripted: Scripted, api: str
) -> None:
    """`OpenAIConversationsSession` keeps the run's items on the server (/v1/conversations):
    the SDK creates the conversation, adds each turn's items, reads them back for the next."""
    scripted.will_reply("Blue.", "Red.")

    async def work(client: openai.AsyncOpenAI) -> tuple[Any, Any, list[Any]]:
        session = OpenAIConversationsSession(openai_client=client)
        agent = chatty(api, client)
        first = await Runner.run(agent, FIRST, session=session)
        second = await Runner.run(agent, SECOND, session=session)
        items = await session.get_items()
        kept = [i async for i in client.conversations.items.list(session.session_id)]
        assert len(kept) == len(items)
        return first.final_output, second.final_output, items

    if api == "chat":
        # The SDK's own: it drops the `id` of the assistant messages it reads back (its session
        # history sanitizer) and its Chat Completions converter then takes a message with a
        # `status` and no `id` for no item it knows. OpenAI's conversation items carry both too;
        # `OpenAIResponsesModel` is unaffected. Fails here once the SDK mends it (openai-agents
        # 0.24.0 cannot replay a Conversations session's assistant messages this way).
        with pytest.raises(agents.UserError, match="Unhandled item type or structure"):
            await in_asyncio(scripted.server, work)
        await idle(scripted.server)
        return
    first, second, items = await in_asyncio(scripted.server, work)
    assert (first, second) == ("Blue.", "Red.")
    second_turn_saw_the_first(scripted)
    said = [(item["role"], item["content"][0]["text"]) for item in items]
    assert said == [
        ("user", FIRST),
        ("assistant", "Blue."),
        ("user", SECOND),
        ("assistant", "Red."),
    ]
    await idle(scripted.server)


@pytest.mark.parametrize("api", ["responses", "websocket"])
async def test_previous_response_id_chains_turns(scripted: Scripted, api: str) -> None:
    scripted.will_reply("Blue.", "Red.")

    async def work(client: openai.AsyncOpenAI) -> tuple[agents.RunResult, agents.RunResult]:
        agent = chatty(api, client)
        first = await Runner.run(agent, FIRST)
        second = await Runner.run(agent, SECOND, previous_response_id=first.last_response_id)
        return first, second

    first, second = await in_asyncio(scripted.server, work)
    assert (first.final_output, second.final_output) == ("Blue.", "Red.")
    assert first.last_response_id and second.last_response_id != first.last_response_id
    second_turn_saw_the_first(scripted)
    await idle(scripted.server)


@pytest.mark.parametrize("api", ["responses", "websocket"])
async def test_a_run_in_a_server_side_conversation(scripted: Scripted, api: str) -> None:
    """`conversation_id=`: the SDK sends only each turn's new input, the server's
    conversation (the Responses `conversation` parameter) holds the rest."""
    scripted.will_reply("Blue.", "Red.")

    async def work(client: openai.AsyncOpenAI) -> tuple[Any, Any, int]:
        conversation = await client.conversations.create()
        agent = chatty(api, client)
        first = await Runner.run(agent, FIRST, conversation_id=conversation.id)
        second = await Runner.run(agent, SECOND, conversation_id=conversation.id)
        kept = [i async for i in client.conversations.items.list(conversation.id)]
        return first.final_output, second.final_output, len(kept)

    first, second, kept = await in_asyncio(scripted.server, work)
    assert (first, second, kept) == ("Blue.", "Red.", 4)
    second_turn_saw_the_first(scripted)
    await idle(scripted.server)


@pytest.mark.parametrize("memory", ["session", "auto_previous_response_id"])
@pytest.mark.parametrize("api", ["responses", "websocket"])
async def test_a_tool_loop_kept_on_the_server_and_replayed(
    scripted: Scripted, api: str, memory: str
) -> None:
    """A turn with a call, its result and the answer kept on the server, by an
    `OpenAIConversationsSession` (function_call and function_call_output items stored through
    /v1/conversations and read back) or by chaining every request of the run to the previous
    response (`auto_previous_response_id`: the call's result goes with only the response id);
    the next turn's prompt holds all of it, once."""
    scripted.will_reply(CALL, "It is sunny in Paris.", "Red.")
    calls = Calls()

    async def work(client: openai.AsyncOpenAI) -> tuple[Any, Any, list[str]]:
        agent = Agent(
            name="weather",
            instructions="Use the tools.",
            model=model_for(api, client),
            model_settings=ModelSettings(temperature=0, max_tokens=60),
            tools=calls.tools(),
        )
        if memory == "session":
            session = OpenAIConversationsSession(openai_client=client)
            first = await Runner.run(agent, "What is the weather in Paris?", session=session)
            second = await Runner.run(agent, "And tomorrow?", session=session)
            kinds = [str(item.get("type")) for item in await session.get_items()]
        else:
            first = await Runner.run(
                agent, "What is the weather in Paris?", auto_previous_response_id=True
            )
            second = await Runner.run(
                agent, "And tomorrow?", previous_response_id=first.last_response_id
            )
            kinds = []
        return first.final_output, second.final_output, kinds

    first, second, kinds = await in_asyncio(scripted.server, work)
    assert (first, second) == ("It is sunny in Paris.", "Red.")
    assert calls.made == [("get_weather", {"city": "Paris"})]
    if memory == "session":
        assert kinds == [
            "message",
            "function_call",
            "function_call_output",
            "message",
            "message",
            "message",
        ]
    prompt = scripted.prompt()
    in_order = [
        "What is the weather in Paris?",
        '{"name": "get_weather", "arguments"',  # the call, not the tool's listing
        "sunny in Paris",
        "It is sunny in Paris.",
        "And tomorrow?",
    ]
    assert [prompt.count(text) for text in in_order] == [1, 1, 2, 1, 1]  # "sunny in Paris" x2
    positions = [prompt.index(text) for text in in_order]
    assert positions == sorted(positions)
    await idle(scripted.server)


@pytest.mark.parametrize("api", API)
async def test_a_handoff_to_another_agent(scripted: Scripted, api: str) -> None:
    """A handoff is a call of `transfer_to_<agent>`: the SDK runs the other agent on the
    conversation so far, with its own instructions."""
    scripted.will_reply(
        '<tool_call>\n{"name": "transfer_to_spanish", "arguments": {}}\n</tool_call>', "Hola."
    )

    async def work(client: openai.AsyncOpenAI) -> agents.RunResult:
        spanish = Agent(
            name="spanish",
            instructions="Answer in Spanish.",
            handoff_description="Speaks Spanish.",
            model=model_for(api, client),
            model_settings=ModelSettings(temperature=0, max_tokens=20),
        )
        triage = Agent(
            name="triage",
            instructions="Hand off to the right agent.",
            model=model_for(api, client),
            model_settings=ModelSettings(temperature=0, max_tokens=60),
            handoffs=[spanish],
        )
        return await Runner.run(triage, "Hello!")

    result = await in_asyncio(scripted.server, work)
    assert result.final_output == "Hola." and result.last_agent.name == "spanish"
    prompt = scripted.prompt()
    assert "Answer in Spanish." in prompt and "Hand off" not in prompt
    assert prompt.index("Hello!") < prompt.index("transfer_to_spanish")
    await idle(scripted.server)


async def test_the_conversations_session_api(server: RunningServer) -> None:
    """The session's own methods on /v1/conversations: items added in requests of at most 20,
    all of them read back in order (the SDK following the pages), the latest `limit` (read
    newest first), the latest popped (deleted), the session cleared (the conversation
    deleted), and a new session starting empty."""
    asks = [f"message {i}" for i in range(25)]

    async def work(client: openai.AsyncOpenAI) -> dict[str, Any]:
        session = OpenAIConversationsSession(openai_client=client)
        await session.add_items([{"role": "user", "content": ask} for ask in asks])
        seen: dict[str, Any] = {
            "all": await session.get_items(),
            "latest": await session.get_items(limit=2),
            "popped": await session.pop_item(),
            "left": await session.get_items(),
        }
        conversation_id = session.session_id
        await session.clear_session()
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(conversation_id)
        seen["new"] = await OpenAIConversationsSession(openai_client=client).get_items()
        return seen

    seen = await in_asyncio(server, work)

    def texts(items: list[Any]) -> list[str]:
        return [item["content"][0]["text"] for item in items]

    assert texts(seen["all"]) == asks
    assert texts(seen["latest"]) == asks[-2:]
    assert texts([seen["popped"]]) == asks[-1:] and texts(seen["left"]) == asks[:-1]
    assert seen["new"] == []
