"""The runner: the one long-lived thread that owns the model and every MLX array.

MLX streams are per thread, so exactly one thread loads the model and runs every step. The thread
is started once by `Runner.run` (`trio.to_thread.run_sync` with its own limiter, never abandoned).

Protocol:
- Trio -> runner: `submit(job, sink)` and `abort(request_id)`, both synchronous and non-blocking.
  Commands go through a thread-safe queue; the thread reads it between steps without a thread
  hop. While it has no work the thread parks in `trio.from_thread.run(...)`, which is where a
  cancelled engine reaches it; while busy it polls `trio.from_thread.check_cancelled()`.
- runner -> Trio: after each step, one `StepEvent` with every live request's new tokens, finishes
  and errors, handed over with `TrioToken.run_sync_soon` (the thread never waits for the event
  loop). On the Trio side `_deliver` fans it out to each request's `TokenSink`; a sink whose
  consumer has gone makes that request abort at the next step boundary.

A step is one prefill chunk or one decode token for each live sequence (the serialized route has
at most one). An exception raised by the model fails that request only; anything that kills the
thread itself fails every live request with `EngineCrashed`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from trio_mlx.actors.stream import TokenSink
from trio_mlx.engine.decode import ActiveSequence, GenerationJob
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.errors import EngineCrashed
from trio_mlx.types import FinishReason, TokenLogprob

log = logging.getLogger(__name__)

#: The runner thread's name while it serves (Trio's worker threads are reused afterwards).
RUNNER_THREAD_NAME = "trio-mlx-runner"

ModelLoader = Callable[[str | Path | None], LoadedModel]


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the engine may know about the loaded model (no MLX objects)."""

    name: str
    path: Path
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: Any
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SequenceEvent:
    """One request's share of a step."""

    request_id: int
    tokens: tuple[int, ...] = ()
    finish: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class _Start:
    job: GenerationJob


@dataclass(frozen=True)
class _Abort:
    request_id: int


@dataclass
class RunnerCounters:
    """Written by the runner thread only; read by anyone (plain ints)."""

    steps: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    started: int = 0
    aborted: int = 0
    failed: int = 0
    busy_seconds: float = 0.0
    live: int = 0


class Runner:
    """Trio-side handle of the runner thread. Create it, `await nursery.start(runner.run)`."""

    def __init__(
        self,
        model: str | Path | None,
        *,
        prefill_step_size: int = 2048,
        max_kv_size: int | None = None,
        loader: ModelLoader = load_model,
    ) -> None:
        self._model_spec = model
        self._prefill_step_size = prefill_step_size
        self._max_kv_size = max_kv_size
        self._loader = loader
        self._commands: queue.SimpleQueue[_Start | _Abort] = queue.SimpleQueue()
        self._wakeup = trio.Event()
        self._sinks: dict[int, TokenSink] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self.counters = RunnerCounters()
        self.info: ModelInfo | None = None
        self.crash: BaseException | None = None

    # ---- Trio side -------------------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the thread, load the model, report `ModelInfo` as started, then serve until
        cancelled. A load error is raised before `started` (so `nursery.start` raises it)."""
        self._token = trio.lowlevel.current_trio_token()
        started = False

        def report_ready(info: ModelInfo) -> None:
            nonlocal started
            self.info = info
            started = True
            task_status.started(info)

        try:
            await trio.to_thread.run_sync(
                self._thread_main, report_ready, limiter=trio.CapacityLimiter(1)
            )
        except Exception as exc:
            if not started:
                raise
            self.crash = exc
            log.exception("the runner thread died")
            self.fail_all("error", f"the engine crashed: {type(exc).__name__}: {exc}")
            # The engine can no longer serve: the owner of the engine learns it through `crash`.
        finally:
            if started:
                self.fail_all("abort", None)

    def submit(self, job: GenerationJob, sink: TokenSink) -> None:
        """Queue `job`; its tokens will be pushed into `sink`."""
        if self.crash is not None:
            raise EngineCrashed(f"the engine crashed: {self.crash}")
        self._sinks[job.request_id] = sink
        self._commands.put(_Start(job))
        self._wakeup.set()

    def abort(self, request_id: int) -> None:
        """Stop generating for `request_id` at the next step boundary. Idempotent."""
        if self._sinks.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))
            self._wakeup.set()

    def fail_all(self, finish: FinishReason, error: str | None) -> None:
        """End every request in flight with `finish` (the engine is closing or has died)."""
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink.push(finish=finish, error=error)
            self._commands.put(_Abort(request_id))

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    async def _wait_for_command(self) -> None:
        while self._commands.empty():
            self._wakeup = trio.Event()
            await self._wakeup.wait()

    def _deliver(self, events: tuple[SequenceEvent, ...]) -> None:
        """On the Trio thread: fan one step's events out to the requests' sinks."""
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue  # aborted meanwhile
            if not sink.push(event.tokens, event.finish, event.error, event.logprobs):
                self.abort(event.request_id)
            elif event.finish is not None:
                del self._sinks[event.request_id]

    # ---- runner thread ---------------------------------------------------------------------

    def _thread_main(self, report_ready: Callable[[ModelInfo], None]) -> None:
        """Body of the runner thread: named `RUNNER_THREAD_NAME` while it runs (Trio reuses its
        worker threads, so the name is given back on the way out)."""
        thread = threading.current_thread()
        previous_name, thread.name = thread.name, RUNNER_THREAD_NAME
        try:
            self._serve_on_this_thread(report_ready)
        finally:
            thread.name = previous_name

    def _serve_on_this_thread(self, report_ready: Callable[[ModelInfo], None]) -> None:
        import mlx.core as mx

        loaded = self._loader(self._model_spec)
        info = ModelInfo(
            name=loaded.name,
            path=loaded.path,
            context_length=loaded.context_length,
            vocab_size=_vocab_size(loaded),
            eos_token_ids=loaded.eos_token_ids,
            tokenizer=loaded.tokenizer,
            config=loaded.config,
        )
        trio.from_thread.run_sync(report_ready, info)
        assert self._token is not None
        deliver = self._token.run_sync_soon
        live: dict[int, ActiveSequence] = {}
        counters = self.counters
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            while True:
                if live:
                    trio.from_thread.check_cancelled()
                else:
                    trio.from_thread.run(self._wait_for_command)
                events = self._take_commands(live, loaded)
                if not live:
                    if events:
                        deliver(self._deliver, tuple(events))
                    continue
                began = time.perf_counter()
                for request_id, seq in list(live.items()):
                    prefill = seq.in_prefill
                    try:
                        result = seq.step()
                    except Exception as exc:
                        log.exception("request %d failed inside the model", request_id)
                        del live[request_id]
                        counters.failed += 1
                        events.append(
                            SequenceEvent(
                                request_id, finish="error", error=f"{type(exc).__name__}: {exc}"
                            )
                        )
                        continue
                    counters.prompt_tokens += result.prefilled
                    if prefill and not result.tokens and result.finish is None:
                        counters.prefill_chunks += 1
                    else:
                        counters.decode_steps += 1
                    counters.generated_tokens += len(result.tokens)
                    if result.tokens or result.finish is not None:
                        finish: FinishReason | None = result.finish  # type: ignore[assignment]
                        events.append(
                            SequenceEvent(request_id, result.tokens, finish, None, result.logprobs)
                        )
                    if result.finish is not None:
                        del live[request_id]
                counters.steps += 1
                counters.live = len(live)
                counters.busy_seconds += time.perf_counter() - began
                if events:
                    deliver(self._deliver, tuple(events))
                if not live:
                    mx.clear_cache()

    def _take_commands(
        self, live: dict[int, ActiveSequence], loaded: LoadedModel
    ) -> list[SequenceEvent]:
        """Apply every queued command; return the events they cause (a job that cannot start)."""
        events: list[SequenceEvent] = []
        vocab_size = self.info.vocab_size if self.info is not None else len(loaded.tokenizer)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Abort):
                if live.pop(command.request_id, None) is not None:
                    self.counters.aborted += 1
                continue
            job = command.job
            try:
                live[job.request_id] = ActiveSequence(
                    job,
                    loaded.model,
                    loaded.eos_token_ids,
                    self._prefill_step_size,
                    vocab_size=vocab_size,
                    max_kv_size=self._max_kv_size,
                )
                self.counters.started += 1
            except Exception as exc:
                log.exception("request %d could not start", job.request_id)
                self.counters.failed += 1
                events.append(
                    SequenceEvent(
                        job.request_id, finish="error", error=f"{type(exc).__name__}: {exc}"
                    )
                )
        self.counters.live = len(live)
        return events


def _vocab_size(loaded: LoadedModel) -> int:
    config = loaded.config
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(size, int) and size > 0:
        return size
    return len(loaded.tokenizer)
