"""Background responses: `background: true` on `POST /v1/responses`, their retrieval while they
run (`GET /v1/responses/{id}`, with `stream=true&starting_after=N` the event stream resumed),
and `POST /v1/responses/{id}/cancel`.

A background request is validated and admitted as any other (`run.start_response`: a refusal is
the `POST`'s error), then handed to a task of the server's own nursery (`serving`), which owns
it from then on (`ownership.disown`): the `POST` answers at once with the response `queued`
(or, with `stream`, follows the response's events as they come), and a client that goes away
leaves the generation running. The task reads the response's events (`stream.ResponseEvents`)
to their end; a streamed one keeps them, numbered from 0, so that any client can follow them
again from any `sequence_number` on (`follow`), the whole stream included once it has ended.

A response is `queued` until its task starts, `in_progress` (with the output written so far)
while it runs, then `completed`, `incomplete` or `failed` as its last event says, or
`cancelled`. A response that ends `completed` or `incomplete` is stored as any other
(`store.ResponseStore`: `previous_response_id`, input items); the registry here keeps the
last `keep` ended ones besides (their objects, and a streamed one's events), at most `max_bytes`
of them (the JSON length of their objects and events: `--response-store-mb`, a budget of its
own), so that a failed or cancelled one can be retrieved too, and forgets the oldest first. An
ended one keeps only these: not its request, its prompt or the conversation it continued.

Cancelling (`cancel`) cancels the task's scope: the request is closed (its slot is free, the
runner aborts it at the next step boundary) and the response ends `cancelled` with the output
written so far; its object is returned. Cancelling one that has ended returns it as it is
(cancelling twice is idempotent, as at OpenAI), a stored one that the registry no longer keeps
included; a response that was not created in the background cannot be cancelled (400); an
unknown id is a 404.

A running background response counts as a request in flight (`ServerState.in_flight`): a
draining server gives it `shutdown_timeout` seconds to end, then closes the engine, which ends it
`failed` (aborted); what is still running when the engine's life ends is cancelled. A task
that fails fails alone: it ends its response `failed`, never the server's nursery. Its
generation is observed in `/metrics` when it ends (`observe`), as a foreground one's is when its
exchange ends: the `POST` that started it counts none.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import trio

from trio_mlx.bounded_map import BoundedMap
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.errors import UNAVAILABLE, APIError
from trio_mlx.http.generation import json_text
from trio_mlx.http.ownership import disown
from trio_mlx.http.responses.store import ResponseStore, response_not_found

if TYPE_CHECKING:
    from trio_mlx.http.responses.run import ResponseRun
    from trio_mlx.http.responses.stream import ResponseEvent, ResponseEvents
    from trio_mlx.http.state import ServerState

log = logging.getLogger("trio_mlx.http")


def check_background(state: ServerState) -> None:
    """A background response is refused (400) where nothing would keep it once it ended."""
    if not state.responses.enabled or not state.background.keep:
        raise APIError(
            400,
            "background mode needs stored responses, and this server keeps none "
            "(--response-store-size or --response-store-mb is 0)",
            param="background",
        )


class BackgroundResponse:
    """One background response: its events (a streamed one's), its state, its task's scope."""

    def __init__(self, run: ResponseRun, events: ResponseEvents, streamed: bool) -> None:
        self.id = run.id
        #: Its run and its events while it runs; let go of once it has ended (`end`).
        self.run: ResponseRun | None = run
        self.streamed = streamed
        self.events: ResponseEvents | None = events
        #: A streamed response's events so far: `log[n]` is the event numbered n.
        self.log: list[ResponseEvent] = []
        self.started = False
        #: Deleted while it ran: not kept once it ends.
        self.forgotten = False
        #: The response object once it has ended.
        self.ended: dict[str, Any] | None = None
        #: What an ended one takes: the JSON length of its object and its events.
        self.size = 0
        self.scope = trio.CancelScope()
        #: Set when its task has ended.
        self.done = trio.Event()
        self._changed = trio.Event()

    @property
    def response(self) -> dict[str, Any]:
        """The response object as it stands (a running one's with its output so far)."""
        if self.ended is not None:
            return self.ended
        assert self.events is not None
        return self.events.partial("in_progress" if self.started else "queued").dump()

    def add(self, batch: list[ResponseEvent]) -> None:
        self.started = True
        if self.streamed:
            self.log += batch
        assert self.events is not None
        final = self.events.final
        if final is not None:
            self.ended = final.dump()
        self._wake()

    def end(self, status: str) -> None:
        """Its task has ended; without the response's last event, the response ends at
        `status` (cancelled, failed) with the output written so far."""
        if self.ended is None:
            self.ended = self._partial(status)
        self.run = self.events = None  # its request, prompt and conversation: not kept
        self.size = len(json_text(self.ended)) + sum(len(data) for _, data in self.log)
        self.done.set()
        self._wake()

    def _partial(self, status: str) -> dict[str, Any]:
        """The response at `status` with its output so far; the bare response, `failed`, when
        that output cannot be written (what failed its task failed it too)."""
        assert self.run is not None and self.events is not None
        try:
            return self.events.partial(status).dump()
        except Exception:
            log.exception("background response %s: its output could not be written", self.id)
        try:
            return self.run.response("failed").dump()
        except Exception:
            log.exception("background response %s: its object could not be written", self.id)
            return {"id": self.id, "object": "response", "status": "failed", "output": []}

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def follow(self, after: int) -> AsyncGenerator[list[ResponseEvent]]:
        """Its events numbered after `after`, in batches as they come, until it has ended."""
        position = max(after + 1, 0)
        while True:
            if position < len(self.log):
                batch, position = self.log[position:], len(self.log)
                yield batch
                continue
            if self.done.is_set():
                return
            await self._changed.wait()


class BackgroundResponses:
    """The server's background responses: the running ones, the last `keep` ended ones, and
    the nursery their tasks run in while the engine serves (`serving`)."""

    def __init__(
        self,
        keep: int,
        max_bytes: int,
        started: Callable[[], None] = lambda: None,
        ended: Callable[[], None] = lambda: None,
        *,
        observe: Callable[[RequestRecord, float], None] = lambda record, elapsed: None,
    ) -> None:
        self.keep = max(0, keep)
        self.max_bytes = max(0, max_bytes)
        #: Called as a task starts and ends: it counts as a request in flight.
        self._started = started
        self._ended = ended
        #: Called once a generation has ended with its record and seconds since it was handed
        #: over (the metrics: the `POST`'s own record ended with no generation in it).
        self._observe = observe
        self._running: dict[str, BackgroundResponse] = {}
        #: The ended ones kept, each counted at its `size`.
        self._done: BoundedMap[str, BackgroundResponse] = BoundedMap(self.keep, self.max_bytes)
        self._nursery: trio.Nursery | None = None

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Background responses may start inside this block; those still running when it
        ends are cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                yield
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    def start(self, run: ResponseRun, events: ResponseEvents, streamed: bool) -> BackgroundResponse:
        """Hand an admitted response over to a task of its own (see the module docstring)."""
        nursery = self._nursery
        if nursery is None:
            run.close()
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests",
                type=UNAVAILABLE,
                code="server_draining",
            )
        disown(run.active)
        # Its own record: the `POST`'s access-log line is written when the `POST` answers.
        record = run.record
        run.record = RequestRecord(model=record.model, prompt_tokens=record.prompt_tokens)
        entry = BackgroundResponse(run, events, streamed)
        self._running[entry.id] = entry
        self._started()
        nursery.start_soon(self._run, entry, time.monotonic(), name=f"background {entry.id}")
        return entry

    async def _run(self, entry: BackgroundResponse, began: float) -> None:
        assert entry.run is not None and entry.events is not None
        run, status = entry.run, "cancelled"
        try:
            with entry.scope:
                async with contextlib.aclosing(entry.events.events()) as batches:
                    async for batch in batches:
                        entry.add(batch)
        except Exception:
            log.exception("background response %s failed", entry.id)
            status = "failed"
        finally:
            run.close()
            self._observe(run.record, time.monotonic() - began)
            entry.end(status)
            self._running.pop(entry.id, None)
            if not entry.forgotten:
                # Not kept when `keep` is 0 or it is larger than `max_bytes` alone.
                self._done.put(entry.id, entry, entry.size)
            self._ended()
            assert entry.ended is not None
            log.info("background response %s ended %s", entry.id, entry.ended["status"])

    def statistics(self) -> dict[str, int]:
        """How many run now, how many ended ones are kept (`/v1/status`)."""
        return {
            "running": len(self._running),
            "ended": len(self._done),
            "max_ended": self.keep,
            "bytes": self._done.bytes,
            "max_bytes": self.max_bytes,
        }

    def get(self, response_id: str) -> BackgroundResponse | None:
        return self._running.get(response_id) or self._done.get(response_id)

    def forget(self, response_id: str) -> bool:
        """Forget a response (`DELETE`), cancelling it if it runs; whether it was here."""
        entry = self._running.pop(response_id, None)
        if entry is not None:
            entry.forgotten = True
            entry.scope.cancel()
        ended = self._done.pop(response_id)
        return ended is not None or entry is not None

    async def cancel(self, response_id: str, store: ResponseStore) -> dict[str, Any]:
        """`POST /v1/responses/{id}/cancel`: the response once cancelled, or as it ended."""
        entry = self.get(response_id)
        if entry is None:
            stored = store.get(response_id)
            if stored is not None and stored.response.get("background"):
                return stored.response  # it ended, and is no longer kept here
            if stored is not None:
                raise APIError(
                    400,
                    "Only responses created with background=true can be cancelled.",
                    param="response_id",
                )
            raise response_not_found(response_id)
        entry.scope.cancel()
        await entry.done.wait()
        return entry.response

    def follow(
        self, response_id: str, starting_after: str | None, store: ResponseStore
    ) -> AsyncGenerator[list[ResponseEvent]]:
        """`GET /v1/responses/{id}?stream=true`: the events of a background response created
        with `stream` after the one numbered `starting_after` (all of them without it)."""
        entry = self.get(response_id)
        stored = store.get(response_id)
        if entry is None and stored is None:
            raise response_not_found(response_id)
        if entry is None and stored is not None and stored.response.get("background"):
            raise APIError(
                400,
                "the events of this background response are no longer kept (the server keeps "
                "those of the latest ended ones, within --response-store-size and "
                "--response-store-mb): retrieve it without stream",
                param="stream",
            )
        if entry is None or not entry.streamed:
            raise APIError(
                400,
                "Only responses created with background=true and stream=true can be streamed "
                "again.",
                param="stream",
            )
        after = -1
        if starting_after is not None:
            try:
                after = int(starting_after)
            except ValueError:
                raise APIError(
                    400, "starting_after must be an integer", param="starting_after"
                ) from None
        return entry.follow(after)
