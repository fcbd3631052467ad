"""Background responses (`background: true`): retrieval while they run, cancellation, a streamed
one followed again from any event, and the server's shutdown, through the official openai
client on the tiny random model.

The reference for a background response's text is the same request run in the foreground:
greedy, the two write the same text.
"""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.types.responses import Response

from idle import wait_until_idle
from model_wrappers import FaultyModel, wrapping_loader
from servers import running_server
from trio_mlx.http.errors import APIError
from trio_mlx.http.responses.background import BackgroundResponses
from trio_mlx.http.responses.store import ResponseStore, StoredResponse
from trio_mlx.http.server import RunningServer, serve_http
from trio_mlx.http.state import ServerSettings

GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "input": "Name a colour."}
#: Without the tiny model's end-of-sequence token, a reply runs to its token limit.
NO_EOS = {"logit_bias": {"2": -100}}
#: A reply long enough to be caught running (and cancelled) on the tiny model.
LONG: dict[str, Any] = {**GREEDY, "max_output_tokens": 900, "extra_body": NO_EOS}
ENDED = ("completed", "incomplete", "failed", "cancelled")


async def retrieved_when(
    client: openai.AsyncOpenAI,
    response_id: str,
    predicate: Callable[[Response], bool],
    seen: list[str] | None = None,
    limit: float = 60.0,
) -> Response:
    """Poll `GET /v1/responses/{id}` until `predicate` holds (its statuses noted in `seen`)."""
    with trio.fail_after(limit):
        while True:
            response = await client.responses.retrieve(response_id)
            if seen is not None and (not seen or seen[-1] != response.status):
                seen.append(response.status)
            if predicate(response):
                return response
            await trio.sleep(0.005)


def writing(response: Response) -> bool:
    """It runs and has written some text."""
    return response.status == "in_progress" and bool(response.output_text)


async def test_a_background_response_runs_to_the_text_of_a_foreground_one(
    client: openai.AsyncOpenAI,
) -> None:
    asked: dict[str, Any] = {**GREEDY, "max_output_tokens": 120, "extra_body": NO_EOS}
    foreground = await client.responses.create(**asked, store=False)
    started = await client.responses.create(**asked, background=True)
    assert started.background is True and started.store is True
    assert started.status in ("queued", "in_progress")
    seen = [started.status]
    ended = await retrieved_when(client, started.id, lambda r: r.status in ENDED, seen)
    # queued (or already in progress), then in progress with its output so far, then ended.
    assert "in_progress" in seen and seen[-1] == "incomplete"
    assert seen.index("in_progress") < len(seen) - 1
    assert ended.output_text == foreground.output_text
    assert ended.usage is not None and ended.usage.output_tokens == 120
    assert ended.background is True
    # Stored as any response: its input items, and a next turn continuing it.
    listed = [item async for item in client.responses.input_items.list(started.id)]
    assert [item.content[0].text for item in listed] == [GREEDY["input"]]  # type: ignore[union-attr]
    continued = await client.responses.create(
        **{**GREEDY, "max_output_tokens": 4, "input": "More?"}, previous_response_id=started.id
    )
    assert continued.status in ("completed", "incomplete")


async def test_a_background_generation_is_counted_in_metrics_when_it_ends(
    http: httpx.AsyncClient, client: openai.AsyncOpenAI
) -> None:
    """`/metrics` counts a background response's generation once, when it ends (its `POST`,
    answered at once, generated nothing): its tokens and its finish."""
    tokens, success = "generation_tokens_total", 'finished_reason="length"'
    before = (await http.get("/metrics")).text
    started = await client.responses.create(
        **{**GREEDY, "max_output_tokens": 12, "extra_body": NO_EOS}, background=True
    )
    await retrieved_when(client, started.id, lambda r: r.status in ENDED)
    after = (await http.get("/metrics")).text
    assert metric(after, tokens) - metric(before, tokens) == 12
    assert (
        metric(after, "request_success_total", success)
        - metric(before, "request_success_total", success)
        == 1
    )


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample of `/metrics` (0 when it has none yet)."""
    pattern = rf"^trio_mlx:{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_background_needs_the_response_stored(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(**GREEDY, background=True, store=False)
    assert refused.value.body == {
        "message": "background mode needs the response stored: store must not be false",
        "type": "invalid_request_error",
        "param": "background",
        "code": "invalid_value",
    }


async def test_cancel_ends_the_generation_and_frees_the_engine(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    before = engine.get_stats()["runner"]["aborted"]
    started = await client.responses.create(**LONG, background=True)
    running = await retrieved_when(client, started.id, writing)
    assert server.state.background.statistics()["running"] == 1
    cancelled = await client.responses.cancel(started.id)
    assert server.state.background.statistics()["running"] == 0
    assert cancelled.status == "cancelled" and cancelled.id == started.id
    # The output written before the cancel is kept, cut short.
    assert running.output_text and cancelled.output_text
    assert cancelled.output_text.startswith(running.output_text)
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before + 1
    assert (await client.responses.retrieve(started.id)).status == "cancelled"
    # Cancelling again answers the same: the response as it ended.
    again = await client.responses.cancel(started.id)
    assert again.status == "cancelled" and again.output_text == cancelled.output_text
    # The engine serves the next request.
    after = await client.responses.create(**GREEDY, max_output_tokens=5, store=False)
    assert after.status in ("completed", "incomplete") and after.usage is not None


async def test_cancel_of_what_is_not_running_in_the_background(
    client: openai.AsyncOpenAI,
) -> None:
    # A background response that ended: returned as it ended.
    done = await client.responses.create(**GREEDY, max_output_tokens=4, background=True)
    ended = await retrieved_when(client, done.id, lambda r: r.status in ENDED)
    kept = await client.responses.cancel(done.id)
    assert kept.status == ended.status != "cancelled"
    assert kept.output_text == ended.output_text
    # A response that was not created in the background cannot be cancelled.
    foreground = await client.responses.create(**GREEDY, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.cancel(foreground.id)
    assert refused.value.body == {
        "message": "Only responses created with background=true can be cancelled.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": "invalid_value",
    }
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.cancel("resp-never-made")
    assert missing.value.body == {
        "message": "Response with id 'resp-never-made' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": "not_found",
    }


async def test_other_requests_keep_streaming_through_a_cancel(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    streamed: list[str] = []
    ended: list[Response] = []
    first_delta = trio.Event()

    async def stream_beside() -> None:
        stream = await client.responses.create(
            **{**GREEDY, "max_output_tokens": 300, "extra_body": NO_EOS},
            store=False,
            stream=True,
        )
        async with stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    streamed.append(event.delta)
                    first_delta.set()
                elif event.type in ("response.completed", "response.incomplete"):
                    ended.append(event.response)

    started = await client.responses.create(**LONG, background=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream_beside)
        await retrieved_when(client, started.id, writing)
        await first_delta.wait()
        cancelled = await client.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        during = len(streamed)
    (beside,) = ended
    assert beside.status == "incomplete" and beside.usage is not None
    assert beside.usage.output_tokens == 300
    assert "".join(streamed) == beside.output_text
    assert len(streamed) > during  # it went on streaming after the cancel
    await wait_until_idle(engine)


async def test_a_background_stream_outlives_its_client_and_resumes(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    asked: dict[str, Any] = {**GREEDY, "max_output_tokens": 200, "extra_body": NO_EOS}
    foreground = await client.responses.create(**asked, store=False)
    aborted = engine.get_stats()["runner"]["aborted"]
    numbers: list[int] = []
    text: list[str] = []
    stream = await client.responses.create(**asked, background=True, stream=True)
    async with stream:
        async for event in stream:
            numbers.append(event.sequence_number)
            if event.type == "response.created":
                response_id = event.response.id
                assert event.response.background is True
            if event.type == "response.output_text.delta":
                text.append(event.delta)
                if len(text) == 3:
                    break  # leaving the stream closes the connection mid-response
    assert numbers == list(range(len(numbers)))
    last = numbers[-1]
    # The generation goes on without its client; the stream resumes after the last event read.
    resumed = await client.responses.retrieve(response_id, stream=True, starting_after=last)
    final = None
    async with resumed:
        async for event in resumed:
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert numbers == list(range(len(numbers)))
    assert final is not None and final.status == "incomplete"
    assert "".join(text) == final.output_text == foreground.output_text
    assert engine.get_stats()["runner"]["aborted"] == aborted
    # Once it has ended, the whole stream can be read again from the start.
    again = await client.responses.retrieve(response_id, stream=True)
    async with again:
        replayed = [event.sequence_number async for event in again]
    assert replayed == numbers
    # A response not streamed in the background has no stream to resume.
    plain = await client.responses.create(**GREEDY, max_output_tokens=4, background=True)
    with pytest.raises(openai.BadRequestError):
        await client.responses.retrieve(plain.id, stream=True, starting_after=0)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp-never-made", stream=True)


async def test_deleting_a_running_background_response_cancels_it(
    server: RunningServer, client: openai.AsyncOpenAI
) -> None:
    engine = server.state.engine
    assert engine is not None
    started = await client.responses.create(**LONG, background=True)
    await retrieved_when(client, started.id, writing)
    await client.responses.delete(started.id)
    await wait_until_idle(engine)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(started.id)


async def test_a_generation_error_ends_it_failed(tiny_model_dir: Path) -> None:
    loader, made = wrapping_loader(lambda inner: FaultyModel(inner, poison=-1))
    async with (
        running_server(tiny_model_dir, loader=loader, served_model_names=("tiny",)) as srv,
        openai.AsyncOpenAI(
            base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30
        ) as client,
    ):
        started = await client.responses.create(**LONG, background=True)
        await retrieved_when(client, started.id, writing)
        made[0].fail_at_position = 0  # the next forward pass fails
        failed = await retrieved_when(client, started.id, lambda r: r.status in ENDED)
        made[0].fail_at_position = None
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "generation_error"
        assert failed.output_text  # what it wrote before the failure
        assert srv.state.engine is not None
        await wait_until_idle(srv.state.engine)
        after = await client.responses.create(**GREEDY, max_output_tokens=4)
        assert after.status in ("completed", "incomplete")


async def test_shutdown_ends_background_responses(tiny_model_dir: Path) -> None:
    settings = ServerSettings(
        model=tiny_model_dir, port=0, served_model_names=("tiny",), shutdown_timeout=0.2
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            srv: RunningServer = await nursery.start(serve_http, settings)
            await srv.state.ready.wait()
            async with openai.AsyncOpenAI(
                base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30
            ) as client:
                started = await client.responses.create(**LONG, background=True)
                await retrieved_when(client, started.id, writing)
            entry = srv.state.background.get(started.id)
            assert entry is not None
            srv.shutdown()  # the drain gives it 0.2 s, then the engine is closed
            await entry.done.wait()
        # serve_http returned by itself: nothing was left running.
    ended = entry.response
    assert ended["status"] == "failed" and ended["error"]["code"] == "aborted"
    assert srv.state.in_flight == 0


async def test_a_server_that_keeps_nothing_refuses_background(tiny_model_dir: Path) -> None:
    async with running_server(
        tiny_model_dir, served_model_names=("tiny",), response_store_size=0
    ) as srv:
        async with openai.AsyncOpenAI(
            base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30
        ) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(**GREEDY, background=True)
    assert refused.value.body["param"] == "background"  # type: ignore[index]


async def test_the_websocket_mode_refuses_background(server: RunningServer) -> None:
    def send_background() -> dict[str, Any]:
        sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with sync.responses.connect() as connection:
            connection.send(
                {"type": "response.create", **GREEDY, "background": True}  # type: ignore[typeddict-item]
            )
            for event in connection:
                return event.to_dict()
        raise AssertionError("the connection ended without an event")

    event = await trio.to_thread.run_sync(send_background)
    assert event["type"] == "error" and event["status"] == 400
    assert event["error"]["param"] == "background"


# The registry itself (`BackgroundResponses`), with stand-ins for a run and its events: what it
# keeps of ended responses, and a task whose failure is its own.


class _Record:
    model = "tiny"
    prompt_tokens = 1


class _Run:
    """A stand-in for an admitted `ResponseRun`: its id, its request, its close."""

    def __init__(self, response_id: str, request: bytes = b"") -> None:
        self.id = response_id
        self.active = object()
        self.record = _Record()
        #: What a real run holds on to: its request's body (its input), its prompt, its stream.
        self.request = request
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Events:
    """A stand-in for `ResponseEvents`: `batches` batches of `size`-byte events, then the end;
    or an error (`fail`), with a `partial` that fails too (`fail_partial`)."""

    def __init__(
        self, run: _Run, batches: int, size: int, fail: bool = False, fail_partial: bool = False
    ) -> None:
        self.run = run
        self.batches, self.size = batches, size
        self.fail, self.fail_partial = fail, fail_partial
        self.final: Any = None

    def partial(self, status: str) -> Any:
        if self.fail_partial:
            raise RuntimeError("the output written so far is broken")
        return _Object({"id": self.run.id, "status": status, "output": []})

    async def events(self) -> Any:
        for n in range(self.batches):
            await trio.lowlevel.checkpoint()
            yield [("response.output_text.delta", "x" * self.size + str(n))]
        if self.fail:
            raise RuntimeError("the reply could not be written")
        self.final = _Object({"id": self.run.id, "status": "completed", "output": []})
        yield [("response.completed", '{"type":"response.completed"}')]


class _Object:
    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def dump(self) -> dict[str, Any]:
        return dict(self.fields)


async def _run_to_end(background: Any, events: _Events, streamed: bool = True) -> Any:
    entry = background.start(events.run, events, streamed=streamed)
    await entry.done.wait()
    return entry


async def test_ended_background_responses_are_kept_within_the_store_s_byte_budget() -> None:
    background = BackgroundResponses(keep=1000, max_bytes=50_000)
    async with background.serving():
        entries = []
        for n in range(10):  # each streamed one's events take about 20 kB
            events = _Events(_Run(f"resp_{n}"), batches=20, size=1000)
            entries.append(await _run_to_end(background, events))
    kept = background.statistics()
    assert kept["ended"] < 10 and kept["bytes"] <= 50_000
    # The newest are kept, the oldest forgotten first.
    assert background.get(entries[-1].id) is entries[-1]
    assert background.get(entries[0].id) is None


async def test_an_ended_background_response_lets_go_of_its_request() -> None:
    background = BackgroundResponses(keep=10, max_bytes=10**9)
    async with background.serving():
        run = _Run("resp_big", request=b"x" * 1_000_000)
        entry = await _run_to_end(background, _Events(run, batches=2, size=10), streamed=False)
    held = weakref.ref(run)
    del run
    gc.collect()
    assert held() is None  # the ended one keeps its object, not its request
    assert background.get("resp_big") is entry
    assert entry.response["status"] == "completed"


async def test_a_background_task_that_fails_badly_fails_alone() -> None:
    counted: list[str] = []
    background = BackgroundResponses(
        keep=10,
        max_bytes=10**9,
        started=lambda: counted.append("started"),
        ended=lambda: counted.append("ended"),
    )
    with trio.fail_after(10):
        async with background.serving():  # the server's nursery: it must not fail
            events = _Events(_Run("resp_bad"), batches=2, size=10, fail=True, fail_partial=True)
            entry = await _run_to_end(background, events)
            assert entry.response["status"] == "failed"
            assert background.statistics()["running"] == 0
            assert counted == ["started", "ended"]  # no longer a request in flight
            assert events.run.closed
            # The server goes on: another one runs to its end.
            after = await _run_to_end(background, _Events(_Run("resp_next"), 2, 10))
            assert after.response["status"] == "completed"


async def test_cancelling_a_background_response_no_longer_kept_as_running_or_ended() -> None:
    """A background response that ended and is stored, but no longer among the ended ones the
    registry keeps, is still a background response: cancelling returns it as it ended."""
    store = ResponseStore()
    response = {"id": "resp_old", "status": "completed", "background": True, "output": []}
    store.put(StoredResponse.of(response, [], None))
    background = BackgroundResponses(keep=10, max_bytes=10**9)
    assert (await background.cancel("resp_old", store))["status"] == "completed"
    foreground = {"id": "resp_fg", "status": "completed", "background": False, "output": []}
    store.put(StoredResponse.of(foreground, [], None))
    with pytest.raises(APIError, match="background=true") as refused:
        await background.cancel("resp_fg", store)
    assert refused.value.status == 400
    # Its stream cannot be followed again: said as such, not as a response never streamed.
    with pytest.raises(APIError, match="no longer kept") as gone:
        background.follow("resp_old", None, store)
    assert gone.value.status == 400 and gone.value.param == "stream"
    with pytest.raises(APIError, match="background=true and stream=true"):
        background.follow("resp_fg", None, store)
