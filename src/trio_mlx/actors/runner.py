"""The runner: the one long-lived thread that owns the model and every MLX array.

MLX streams are per thread, so exactly one thread loads the model and runs every step. The thread
runs on a thread from `runner_threads` (process-wide, parked between engines, never exiting: see
there why MLX's thread-local state must not be torn down by a thread exit), from `Runner.run`
until the runner stops.

Protocol (its messages and counters: `runner_protocol`):
- Trio -> runner: `submit(job, sink)` and `abort(request_id)`, both synchronous and non-blocking.
  Commands go through a thread-safe queue; the thread reads it between steps without a thread
  hop. While it has no work the thread parks on a `threading.Event`; a stop request (the `run`
  task cancelled: the engine is closing) wakes it, and while busy it checks for one before each
  step.
- runner -> Trio: after each step, one batch of `SequenceEvent`s with every live request's new
  tokens, finishes and errors, posted to the `handoff.Handoff` (the event loop woken without
  the thread giving its GIL away); readiness and the answer to a `ClearSnapshots` go the same
  way. The thread never waits for the event loop (the
  prefix-cache book it consults is thread-safe and called directly: `snapshot_keeper`). On the
  Trio side `_deliver` fans a batch out to each request's `TokenSink`; a sink whose consumer has
  gone makes that request abort at the next step boundary.

Start-up (`runner_start`, on the thread, before `started`): the models are loaded, then the fast
decode step, the prefill plan, the route and the speculator are chosen.

Two routes, chosen once the model is loaded:
- serialized (`max_num_seqs == 1`, or a model whose cache cannot be batched):
  `serial_loop.serve_serialized`: a step is one prefill chunk or one decode token of each live
  sequence (`decode.ActiveSequence`), or the vision encoding of a request with media
  (`multimodal.job.MultimodalSequence`, whose first step it is; with an mlx-vlm drafter,
  `multimodal.drafted.DraftedMultimodalSequence`: mlx-vlm's speculative loop, a token a step);
- batched (`max_num_seqs > 1`): `batch_loop.serve_batched`, one decode step over every running
  sequence plus a prefill chunk of those waiting to join (continuous batching). On a
  vision-language model its text-only requests batch like a text model's; its requests with
  media carry per-request prompt embeddings and positions that the batched step does not take,
  so they step one by one beside the batch (`media_lane.MediaLane`).
Prefill chunks are sized by measured time (`scheduling.PrefillPacer`, calibrated by one short
timed pass at load), so that an abort takes effect within about `prefill_chunk_seconds` on any
backend. An exception raised by the model fails the requests it can be attributed to; anything
that kills the thread itself fails every live request with `EngineCrashed`.

Prefix caching (when a `KVCacheManager` is attached and enabled), through the runner's
`SnapshotKeeper` (which holds the snapshots and talks to the book):
- a new job starts from the keeper's restored copy of the longest cached prefix, if any, and
  prefills the rest;
- a prefill chunk that reaches one of the job's store points (a chat's system prompt; the whole
  prompt but its last token where the final entry cannot serve a retry): the keeper snapshots
  the cache's first that-many tokens (prefill runs past the points when the model's cache can be
  cut afterwards, and stops at them otherwise);
- the end of a request whose prefill completed (finished, or aborted, e.g. by a stop string):
  the keeper snapshots what the cache holds, keyed by `ActiveSequence.fed_tokens()`.
  A step's new tokens are delivered before its snapshots are taken (a request's first token
  does not wait for the snapshot of its system prompt), its finishes after them (a request that
  has ended has its entries in the book). A request aborted during prefill, or one that failed,
  stores nothing at its end.
- `ClearSnapshots`: drops every snapshot, empties the book, frees MLX's buffer cache.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import outcome
import trio

from trio_mlx.actors.batch_loop import serve_batched
from trio_mlx.actors.handoff import Handoff
from trio_mlx.actors.kv_cache import CacheKind
from trio_mlx.actors.kv_cache_manager import KVCacheManager
from trio_mlx.actors.model_info import ModelInfo
from trio_mlx.actors.runner_protocol import (
    AbortJob,
    Answer,
    ClearSnapshots,
    Command,
    RunnerCounters,
    SequenceEvent,
    StartJob,
)
from trio_mlx.actors.runner_start import ModelLoader, StartOptions, load_models, prepare_serving
from trio_mlx.actors.runner_threads import RUNNER_THREAD_NAME as RUNNER_THREAD_NAME
from trio_mlx.actors.runner_threads import (
    runner_stream,
    start_runner_thread,
)
from trio_mlx.actors.serial_loop import serve_serialized
from trio_mlx.actors.snapshot_keeper import SnapshotKeeper
from trio_mlx.actors.stream import TokenSink
from trio_mlx.engine.compiled_step import CompiledDecode
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.engine.scheduling import DEFAULT_CHUNK_SECONDS, PrefillPacer
from trio_mlx.engine.specprefill import SpecPrefillCounters, SpecPrefillSettings
from trio_mlx.engine.speculative import DEFAULT_NUM_DRAFT_TOKENS, Speculator
from trio_mlx.errors import EngineCrashed
from trio_mlx.multimodal.drafted import DraftedMultimodalSequence, MediaDrafter, MediaSequence
from trio_mlx.multimodal.job import MultimodalJob, MultimodalSequence
from trio_mlx.multimodal.joining import JoiningMediaSequence
from trio_mlx.multimodal.vision import VisionFeatureCache
from trio_mlx.types import FinishReason

log = logging.getLogger(__name__)

#: Seconds without work after which the runner frees MLX's buffer cache.
IDLE_TRIM_SECONDS = 30.0


class Runner:
    """Trio-side handle of the runner thread. Create it, `await nursery.start(runner.run)`."""

    def __init__(
        self,
        model: str | Path | None,
        *,
        prefill_step_size: int = 2048,
        prefill_block: int | None = None,
        fused_tail_tokens: int | None = None,
        max_kv_size: int | None = None,
        max_num_seqs: int = 1,
        prefill_chunk_seconds: float = DEFAULT_CHUNK_SECONDS,
        compiled_decode: bool | None = None,
        traced_batch_rows: int | None = None,
        fused_projections: bool | None = None,
        lean_decode: bool | None = None,
        dequantize_from_rows: int | None = None,
        loader: ModelLoader = load_model,
        draft_model: str | Path | None = None,
        draft_layers: int | tuple[int, ...] | None = None,
        num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        mtp: bool = False,
        mtp_num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        specprefill_model: str | Path | None = None,
        specprefill_layers: int | tuple[int, ...] | None = None,
        specprefill: SpecPrefillSettings | None = None,
        mllm_draft_model: str | Path | None = None,
        mllm_draft_kind: str | None = None,
        mllm_draft_block_size: int | None = None,
    ) -> None:
        self._options = StartOptions(
            model=model,
            loader=loader,
            max_kv_size=max_kv_size,
            max_num_seqs=max_num_seqs,
            prefill_step_size=prefill_step_size,
            fused_tail_tokens=fused_tail_tokens,
            prefill_block=prefill_block,
            prefill_chunk_seconds=prefill_chunk_seconds,
            compiled_decode=compiled_decode,
            traced_batch_rows=traced_batch_rows,
            fused_projections=fused_projections,
            lean_decode=lean_decode,
            dequantize_from_rows=dequantize_from_rows,
            draft_model=draft_model,
            draft_layers=draft_layers,
            mtp=mtp,
            num_draft_tokens=mtp_num_draft_tokens if mtp else num_draft_tokens,
            specprefill_model=specprefill_model,
            specprefill_layers=specprefill_layers,
            mllm_draft_model=mllm_draft_model,
            mllm_draft_kind=mllm_draft_kind,
            mllm_draft_block_size=mllm_draft_block_size,
        )
        #: speculative decoding (`engine/speculative.py`: a draft model, or the MTP head)
        self.speculator: Speculator | None = None
        self.specprefill = specprefill or SpecPrefillSettings()
        #: the model SpecPrefill scores with (loaded when `specprefill_model` is given)
        self.scorer: Any = None
        self.specprefill_counters = SpecPrefillCounters()
        #: the mlx-vlm drafter of requests with media (`multimodal.drafted`), None without one
        self.media_drafter: MediaDrafter | None = None
        self.max_num_seqs = max_num_seqs
        self.pacer = PrefillPacer(prefill_step_size, target_seconds=prefill_chunk_seconds)
        #: KV cache bytes per token of one sequence (measured once the model is loaded)
        self.kv_bytes_per_token = 0
        #: whether the batched route serves (max_num_seqs > 1 and a cache that can be merged)
        self.batching = False
        self._prefill_plan = PrefillPlan(prefill_step_size)  # chosen again once a model is loaded
        self._max_kv_size = max_kv_size
        #: the model's traced decode step (`fast_decode`), None when off or unsupported
        self.compiled: CompiledDecode | None = None
        #: the model's lean one-token step (`fast_decode.prepare_lean_step`), None when off
        self.lean: LeanStep | None = None
        #: the traced batch step of small batches (`fast_decode.prepare_batch_step`) and the
        #: most rows it takes
        self.batch_step: CompiledDecode | None = None
        self.traced_batch_rows = 0
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()  # set whenever a command is queued, or to stop
        self._stop = threading.Event()
        #: Set by the runner thread once its model is loaded (before it checks for a stop).
        self._loaded = threading.Event()
        self._sinks: dict[int, TokenSink] = {}
        #: requests on their way here (`Engine.arriving`: from an HTTP request's arrived body, or
        #: an engine call's start, until it enters admission): written on the Trio thread
        #: (`expect`), read by the runner thread (`batch_loop`: a burst's first arrivals wait)
        self.arriving = 0
        #: the hand-over of the runner thread's events to the Trio thread (made by `run`)
        self._handoff: Handoff | None = None
        self.counters = RunnerCounters()
        self.info: ModelInfo | None = None
        self.crash: BaseException | None = None
        self._snapshots = SnapshotKeeper()
        self.snapshot_counters = self._snapshots.counters
        self._replies: set[Answer] = set()
        self._serving = False
        #: vision features of recent media (runner thread only; statistics read anywhere)
        self.vision_cache = VisionFeatureCache()

    # ---- Trio side -------------------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the thread, load the model, report `ModelInfo` as started, then serve until
        cancelled. A load error is raised before `started` (so `nursery.start` raises it)."""
        handoff = self._handoff = Handoff()
        started = False

        def report_ready(info: ModelInfo) -> None:
            # On the Trio thread, handed over by the Handoff (the thread does not wait).
            nonlocal started
            started = self._serving = True
            task_status.started(info)

        try:
            await self._run_thread(report_ready)
        except Exception as exc:
            if not started:
                raise
            self.crash = exc
            log.exception("the runner thread died")
            self.fail_all("error", f"the engine crashed: {type(exc).__name__}: {exc}")
            # The engine can no longer serve: the owner of the engine learns it through `crash`.
        finally:
            self._serving = False
            for reply in list(self._replies):
                reply.resolve(None)
            if started:
                self.fail_all("abort", None)
            handoff.close()

    async def _run_thread(self, report_ready: Callable[[ModelInfo], None]) -> None:
        """Run `_thread_main` on a runner thread until it returns; re-raise what it raised.

        Cancelled once the model is loaded: ask the thread to stop at its next step boundary
        and wait for it (shielded: at most one step), then re-raise the cancellation. Cancelled
        while the model is still loading: a load is one long call that cannot be interrupted,
        so it is not waited for; the thread finishes the load, sees the stop right after it,
        drops the model on its own thread and parks (`runner_threads`). Its outcome (the
        model, or a load error) goes with it, unreported; a process that ends meanwhile waits
        for it (`RunnerJob.abandon`: torn down inside MLX, the process would abort)."""
        handoff = self._handoff
        assert handoff is not None
        finished = trio.Event()
        result: list[outcome.Outcome[None]] = []

        def body() -> None:
            captured = outcome.capture(self._thread_main, report_ready)
            result.append(captured)
            if isinstance(captured, outcome.Error) and self._stop.is_set():
                log.info("an abandoned model load ended with %r", captured.error)

        def done() -> None:
            with contextlib.suppress(trio.RunFinishedError):  # the run is gone: nobody waits
                handoff.post(finished.set)

        thread_job = start_runner_thread(body, done)
        try:
            await handoff.serve_until(finished)
        finally:
            self._stop.set()
            self._wakeup.set()
            if self._loaded.is_set():
                with trio.CancelScope(shield=True):
                    await handoff.serve_until(finished)
            else:  # abandoned mid-load (see the docstring); the process's exit waits for it
                thread_job.abandon()
        result[0].unwrap()

    def use_prefix_cache(self, manager: KVCacheManager) -> None:
        """Attach the kv_cache actor. Call once, before the first `submit`."""
        self._snapshots.attach(manager)

    async def clear_snapshots(self) -> dict[str, Any] | None:
        """Drop every snapshot on the runner thread, empty the book, and free MLX's buffer cache,
        between two steps. Returns what was freed, or None when the runner is not serving."""
        if not self._serving or self.crash is not None:
            return None
        reply = Answer()
        self._replies.add(reply)
        try:
            self._commands.put(ClearSnapshots(reply))
            self._wakeup.set()
            await reply.event.wait()
        finally:
            self._replies.discard(reply)
        return reply.value

    def expect(self, n: int) -> None:
        """`n` more (or, negative, fewer) requests are on their way to `submit`."""
        self.arriving += n
        if self.arriving <= 0:
            self.arriving = 0
            self._wakeup.set()

    def submit(self, job: GenerationJob, sink: TokenSink) -> None:
        """Queue `job`; its tokens will be pushed into `sink`."""
        if self.crash is not None:
            raise EngineCrashed(f"the engine crashed: {self.crash}")
        self._sinks[job.request_id] = sink
        self._commands.put(StartJob(job))
        self._wakeup.set()

    def abort(self, request_id: int) -> None:
        """Stop generating for `request_id` at the next step boundary. Idempotent."""
        if self._sinks.pop(request_id, None) is not None:
            self._commands.put(AbortJob(request_id))
            self._wakeup.set()

    def fail_all(self, finish: FinishReason, error: str | None) -> None:
        """End every request in flight with `finish` (the engine is closing or has died)."""
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink.push(finish=finish, error=error)
            self._commands.put(AbortJob(request_id, store=False))

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    def _wait_for_command(self) -> bool:
        """On the runner thread: block until a command is queued (True) or a stop is asked
        (False). After `IDLE_TRIM_SECONDS` with nothing to do, MLX's buffer cache is returned to
        the device once (a request arriving sooner reuses the buffers of the one before instead
        of allocating them again)."""
        import mlx.core as mx

        trimmed = False
        while self._commands.empty():
            if self._stop.is_set():
                return False
            if self._wakeup.wait(None if trimmed else IDLE_TRIM_SECONDS):
                self._wakeup.clear()
            elif not trimmed:
                mx.clear_cache()
                trimmed = True
        return not self._stop.is_set()

    def _deliver(self, events: tuple[SequenceEvent, ...]) -> None:
        """On the Trio thread: fan one step's events out to the requests' sinks."""
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue  # aborted meanwhile
            if not sink.push(
                event.tokens, event.finish, event.error, event.logprobs, event.cached_tokens
            ):
                self.abort(event.request_id)
            elif event.finish is not None:
                del self._sinks[event.request_id]

    # ---- runner thread ---------------------------------------------------------------------

    def _thread_main(self, report_ready: Callable[[ModelInfo], None]) -> None:
        """Body of the runner thread (named `RUNNER_THREAD_NAME`)."""
        try:
            self._serve_on_this_thread(report_ready)
        finally:
            self._snapshots.drop_all()  # MLX arrays are released on their own thread
            # their traces (the lean step: views of its weights) hold the model's arrays
            self.compiled = self.batch_step = self.lean = None

    def _serve_on_this_thread(self, report_ready: Callable[[ModelInfo], None]) -> None:
        """Load (`runner_start`), report ready, then serve on the route chosen at start-up."""
        import mlx.core as mx

        models = load_models(self._options)
        self.scorer = models.scorer
        self.media_drafter = models.media_drafter
        self._loaded.set()
        if self._stop.is_set():  # cancelled while loading: nobody waits for this model
            return
        setup = prepare_serving(models, self._options)
        self.compiled = setup.compiled
        self.lean = setup.lean
        self.batch_step, self.traced_batch_rows = setup.batch_step, setup.traced_batch_rows
        self._prefill_plan = setup.prefill_plan
        self.pacer = setup.pacer
        self.kv_bytes_per_token = setup.kv_bytes_per_token
        self.batching = setup.batching
        self.speculator = setup.speculator
        assert self._handoff is not None
        self.info = setup.info  # before any job can arrive: jobs come after `started`
        self._handoff.post(report_ready, setup.info)
        with mx.stream(runner_stream()):
            if self.batching:
                serve_batched(self, models.target)
            else:
                serve_serialized(self, models.target)

    def _emit(
        self,
        events: list[SequenceEvent],
        stores: list[tuple[Any, CacheKind, int | None]],
        after_tokens: Callable[[], None] | None = None,
    ) -> None:
        """Hand a step's events to Trio and take its snapshots. Tokens first: a snapshot must
        not delay them; then `after_tokens` (the next step queued on the device:
        `BatchDecoder.dispatch_pending`). Finishes after the snapshots: a finished request's
        entries are in the book when it ends."""
        assert self._handoff is not None
        deliver = self._handoff.post
        # with no snapshot to take, the finishes go with the tokens
        first = tuple(e for e in events if e.finish is None) if stores else tuple(events)
        if first:
            deliver(self._deliver, first)
        if after_tokens is not None:
            after_tokens()
        for seq, kind, length in stores:
            self._snapshots.store(seq, kind, length)
        finishes = tuple(e for e in events if e.finish is not None) if stores else ()
        if finishes:
            deliver(self._deliver, finishes)

    def _multimodal_sequence(
        self, job: MultimodalJob, loaded: LoadedModel, vocab_size: int
    ) -> MediaSequence:
        """A request with media on a vision-language model, to decode where it steps
        (`_media_sequence` without a way into the batch)."""
        seq = self._media_sequence(job, loaded, vocab_size, None)
        assert not isinstance(seq, JoiningMediaSequence)
        return seq

    def _media_sequence(
        self,
        job: MultimodalJob,
        loaded: LoadedModel,
        vocab_size: int,
        joining: Callable[[MultimodalJob, list[Any] | None, int], JoiningMediaSequence | None]
        | None,
    ) -> MediaSequence | JoiningMediaSequence:
        """A request with media on a vision-language model: with an mlx-vlm drafter and
        sampling its loop honours, mlx-vlm's drafted decode (`multimodal.drafted`, no prefix
        cache); else from the longest cached prefix with the same tokens and the same media
        (its cache key): what `joining` makes of it (the batched route: a sequence that will
        join the batch, `multimodal.joining`), or where it gives None a `MultimodalSequence`."""
        if loaded.multimodal is None:
            raise ValueError("this model takes text only")
        drafter = self.media_drafter
        if drafter is not None:
            declined = drafter.declines(job)
            if declined is None:
                self.counters.media_drafted += 1
                return DraftedMultimodalSequence(
                    job,
                    loaded.multimodal,
                    drafter,
                    loaded.eos_token_ids,
                    prefill_step_size=self._prefill_plan.step,
                )
            log.debug("request %d decodes without the drafter: %s", job.request_id, declined)
        cache, cached_tokens = self._snapshots.restore_for(job.keyed())
        if joining is not None:
            joiner = joining(job, cache, cached_tokens)
            if joiner is not None:
                return joiner
        return MultimodalSequence(
            job,
            loaded.multimodal,
            self.vision_cache,
            loaded.eos_token_ids,
            self._prefill_plan,
            vocab_size=vocab_size,
            max_kv_size=self._max_kv_size,
            cache=cache,
            cached_tokens=cached_tokens,
        )
