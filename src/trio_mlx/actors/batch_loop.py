"""The runner thread's batched route (`max_num_seqs > 1`): continuous batching.

The loop, top to bottom, once per step while anything is live:
1. apply the commands queued since the last step (`_apply`): a new job starts prefilling from its
   restored prefix (a long prompt under SpecPrefill, when a scoring model is loaded: from no
   cached prefix, scored then sparsely prefilled, `batch_specprefill`), an abort takes its
   sequence out (a waiting one at once, between two of its chunks; a row leaves the batch at the
   next step);
2. one decode step over every row of the batch (`BatchDecoder.decode`): its tokens and finishes
   go to Trio at once (where `BatchDecoder.dispatch_order` defers, the next step, built, is
   queued on the device only then: `dispatch_order` says why), then the finished sequences'
   snapshots are taken. With
   `BatchDecoder.mixing`, waiting prompts' next chunks ride in the step's forward pass
   (`mixed_step`, sized by `PrefillPacer.mixed_tokens`), and step 4 takes those chunks' results
   instead of running chunks of their own. With a draft model, a
   batch of one row takes a speculative step instead (`BatchDecoder.speculate`: several tokens
   for that row); a lone greedy row under a grammar whose last token was forced, a jump-forward
   step (`BatchDecoder.jump`: the tokens its grammar forces next in one pass); as soon as a
   second row joins, the batch decodes one token a step again;
3. on a vision-language model, one step of each request with media in the media lane
   (`media_lane.MediaLane`): its vision step and its prefill beside the batch, then, where it
   can, it joins the batch to decode (`multimodal.joining`); where it cannot, it decodes there,
   step for step beside the batch (see there why); then the commands queued meanwhile are
   applied (a request aborted during its vision step leaves before any of its prompt is
   prefilled);
4. when sequences wait to join, one prefill chunk under the pacer's budget (`PrefillPacer`:
   measured time, held to a couple of decode steps while rows decode, so a long prompt arriving
   does not stall the streams already decoding, more when many wait beside a small batch; with
   `BatchDecoder.group_prefill`, the short prompts of several arrivals in one pass), its
   store-point snapshots, and the sequences whose prefill is complete join the batch — unless a
   burst is arriving at an idle batch (below), or, while rows decode, a prompt of several chunks
   has just run its last one: it joins at the next step (`BatchDecoder.join`'s `defer_long`: its
   last chunk and its wide join would both lengthen the same gap). A request with media alone in
   the batch takes its first token from its prompt's last pass here (`engine.batch_lone_media`),
   sent at once.

A burst on an idle batch: requests reach the runner one at a time (each read, validated and
prepared in turn: over HTTP a 16-request burst took tens of ms to arrive), and an idle batch's
prefill pass takes what is waiting when it starts. Joined as they came, the first arrivals would
decode alone, each later arrival's prefill would then be held to a couple of decode steps of the
growing batch, and every join would give the batch a new shape, where the same burst through the
engine API has all 16 waiting before the first pass. So while nothing decodes and requests are
known to be on their way (`Runner.arriving`: noted from an HTTP request's arrived body, or an
engine call's start, until it enters admission), the sequences already prefilled wait: the
runner prefills the others as they come, sleeps when there is nothing to prefill, and they join
together once none is on its way any more, or after `BURST_HOLD_SECONDS`
(`RunnerCounters.burst_holds`, `burst_hold_seconds`). A lone request is not held: its own
arrival ends before the runner has it. The bound is short: where the server's intake is slow
next to the runner, the first arrivals would otherwise wait for all of it (measured on the CPU
with the engine API, arrivals spread over 80 ms: a 100 ms bound made the median time to first
token 1.5x what no hold gave; over 30 ms, 50 ms made it 0.8x; docs/benchmarks).

The protocol with Trio is the serialized route's (see `runner`): one `SequenceEvent` batch per
step posted to the runner's `Handoff`, `Runner.submit` / `Runner.abort` / `TokenSink.push`
unchanged.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING, Any, cast

from trio_mlx.actors.kv_cache import CacheKind
from trio_mlx.actors.media_lane import MediaLane
from trio_mlx.actors.runner_protocol import AbortJob, ClearSnapshots, SequenceEvent, StepRecord
from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.batch_join import PrefillResult
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.fast_decode import compiled_batch_enabled
from trio_mlx.engine.loading import LoadedModel
from trio_mlx.engine.prefill_shapes import (
    padded_prefill_agrees,
    padded_prefill_default,
    warm_graphs,
)
from trio_mlx.multimodal.job import MultimodalJob
from trio_mlx.types import FinishReason

if TYPE_CHECKING:
    from trio_mlx.actors.runner import Runner
    from trio_mlx.engine.scheduling import PrefillPacer

log = logging.getLogger(__name__)

_Stores = list[tuple[Any, CacheKind, int | None]]


#: MLX's buffer cache while the batched route serves (bytes). Joining, leaving and growing the
#: batch copy its whole KV cache into arrays of new sizes (mlx-lm's `extend` / `filter`); without a
#: bound the freed buffers pile up in MLX's cache (80 GB for the 8B bf16 shape at 64 streams on
#: the H200, until a shared GPU ran out of memory). Per-step temporaries need far less than this.
BATCH_CACHE_LIMIT = 4 << 30

#: How long the first arrivals of a burst on an idle batch may wait, prefilled, for the requests
#: still on their way before they start decoding (seconds; module docstring).
BURST_HOLD_SECONDS = 0.05


def serve_batched(runner: Runner, loaded: LoadedModel) -> None:
    """Serve `runner`'s commands on this (the runner) thread until it is asked to stop."""
    import mlx.core as mx

    previous = mx.set_cache_limit(BATCH_CACHE_LIMIT)
    if previous < BATCH_CACHE_LIMIT:
        mx.set_cache_limit(previous)  # already lower: keep it
    info = runner.info
    support = info.cache_support if info is not None else None
    plan = runner._prefill_plan
    traced_everywhere = compiled_batch_enabled() and runner.compiled is not None
    batch = BatchDecoder(
        loaded.model,
        loaded.eos_token_ids,
        vocab_size=info.vocab_size if info is not None else len(loaded.tokenizer),
        plan=plan,
        max_kv_size=runner._max_kv_size,
        split_at_store_points=not (support is not None and support.trimmable),
        # every size with TRIO_MLX_COMPILED_BATCH=on and compiled_decode; else small batches
        compiled=runner.compiled if traced_everywhere else runner.batch_step,
        compiled_rows=None if traced_everywhere else runner.traced_batch_rows,
        lean=runner.lean,
        padded_prefill=_padded_prefill(loaded.model, plan.block, plan.step),
    )
    lane = MediaLane(runner, loaded, batch)
    counters = runner.counters
    pacer = runner.pacer
    since_join: int | None = None  # steps since the last join (None: none yet)
    mixed_before = 0  # prompt tokens that rode in the pass queued at the last step
    held_since: float | None = None
    while True:
        busy = batch.busy or len(lane) > 0
        if runner._stop.is_set() or (not busy and not runner._wait_for_command()):
            return
        events = _apply(runner, batch, lane)
        if not batch.busy and not lane:
            runner._emit(events, [])
            continue
        began = time.perf_counter()
        decode_seconds = prefill_seconds = 0.0
        prompt_tokens = mixed_tokens = 0  # prefilled in chunks of their own / in the pass
        stores: _Stores = []
        rows = batch.decoding
        mixed: list[PrefillResult] = []  # a waiting prompt's chunk in the decode step's pass
        if rows or batch.rows:
            # A lone row speculates with the draft; several decode together without it.
            speculator = runner.speculator if batch.can_speculate() else None
            jumping = speculator is None and batch.can_jump()
            solo = speculator is not None or jumping
            if speculator is not None:
                step = batch.speculate(speculator)
            elif jumping:
                step = batch.jump()
            else:
                waiting = len(batch.waiting)
                mix = pacer.mixed_tokens(rows, waiting) if batch.mixing and waiting else 0
                step = batch.decode(mix)
                mixed = batch.take_mixed()
                counters.mixed_chunks = batch.mixed_chunks
            for result in step:
                events.append(
                    _row_event(
                        result.seq, result.tokens, result.finish, result.error, result.logprobs
                    )
                )
                counters.generated_tokens += len(result.tokens)
                if result.error is not None:
                    counters.failed += 1
                    log.error("request %d failed: %s", result.seq.request_id, result.error)
                elif result.finish is not None:
                    stores.append((result.seq, "conversation", None))
            counters.grouped_attention_steps = batch.grouped_attention_steps
            counters.segmented_steps = batch.segmented_steps
            counters.traced_steps = batch.traced_steps
            counters.deferred_dispatches = batch.dispatch_order.deferred
            if rows and not solo:
                mixed_before = _observe_step(
                    pacer, time.perf_counter() - began, mixed, mixed_before, batch.pipelined
                )
                counters.decode_steps += 1
                counters.batch_sizes[rows] = counters.batch_sizes.get(rows, 0) + 1
            counters.live = batch.live + len(lane)  # before the finishes reach Trio
            # the next step, if built only, queued once its predecessor's tokens are handed over
            runner._emit(events, stores, after_tokens=batch.dispatch_pending)
            events, stores = [], []
            decode_seconds = time.perf_counter() - began
        if lane:
            lane.step(batch.decoding, 1, events, stores)
            # A vision step may take long: what was aborted meanwhile (a request that has just
            # joined the batch's waiting sequences included) leaves before the prefill chunk.
            events += _apply(runner, batch, lane)
            counters.live = batch.live + len(lane)  # before the finishes reach Trio
            runner._emit(events, stores)
            events, stores = [], []
        if batch.waiting or mixed:
            decoding, waiting = batch.decoding, len(batch.waiting)
            chunk_began = time.perf_counter()
            if mixed:  # (a media step may have aborted its sequence since: it is gone)
                results = [r for r in mixed if r.error is not None or r.seq in batch.waiting]
            else:
                results = batch.prefill(
                    pacer.chunk_tokens(decoding, waiting), pacer.budget_seconds(decoding, waiting)
                )
            prefilled, grouped, scored, firsts = 0, 0, 0, 0
            for pre in results:
                seq = pre.seq
                if pre.error is not None:
                    counters.failed += 1
                    log.error("request %d failed in prefill: %s", seq.request_id, pre.error)
                    events.append(_row_event(seq, (), "error", pre.error))
                    continue
                prefilled += pre.prefilled
                grouped += pre.grouped
                scored += pre.scored
                if pre.first_token:  # a lone request with media: its first token, at once
                    firsts += 1
                    events.append(_row_event(seq, pre.tokens, pre.finish, None, pre.logprobs))
                    counters.generated_tokens += len(pre.tokens)
                    if pre.finish is not None:
                        stores.append((seq, "conversation", None))
                last = len(seq.job.prompt_tokens) - 1
                for point in pre.store_points:
                    stores.append((seq, "prompt" if point == last else "system", point))
            if mixed:
                mixed_tokens = prefilled
            else:
                prompt_tokens = prefilled
            if grouped:
                counters.prefill_groups += 1
                counters.grouped_prefills += grouped
            counters.prefill_group_failures = batch.group_failures
            if prefilled and not grouped and not scored and not firsts and not mixed:
                # (a pass of several prompts is faster per token than a chunk; a scoring chunk's
                # time is the scoring model's, not the target's; a first token's pass waited
                # for its token)
                pacer.observe_chunk(prefilled, time.perf_counter() - chunk_began)
            if prefilled or scored:
                counters.prefill_chunks += 1
            counters.prompt_tokens += prefilled
            counters.live = batch.live + len(lane)  # before the finishes reach Trio
            runner._emit(events, stores)
            prefill_seconds = time.perf_counter() - chunk_began
            # A burst on an idle batch: its first arrivals wait, prefilled, for the rest of it.
            holding = _burst_arriving(runner, batch, lane)
            if holding and held_since is None:
                held_since = time.perf_counter()
                counters.burst_holds += 1
            if held_since is not None:
                holding = holding and time.perf_counter() - held_since < BURST_HOLD_SECONDS
            # a long prompt's last chunk and its join (a wide re-layout) in separate steps
            joined = 0 if holding else batch.join(defer_long=decoding > 0 and prefilled > 0)
            counters.deferred_joins = batch.deferred_joins
            if joined:  # each joiner's last prompt token, fed by the next step
                counters.prompt_tokens += batch.joined_prompt_tokens
        else:
            joined, holding = 0, False
        counters.steps += 1
        counters.live = batch.live + len(lane)
        counters.decoding = batch.decoding
        counters.prefilling = len(batch.waiting)
        counters.kv_bytes = batch.kv_bytes()
        seconds = time.perf_counter() - began
        counters.busy_seconds += seconds
        counters.note_step(
            StepRecord(
                seconds,
                decode_seconds,
                prefill_seconds,
                since_join,
                rows,
                prompt_tokens,
                mixed_tokens,
            )
        )
        since_join = 1 if joined else None if since_join is None else since_join + 1
        if batch.rows or not batch.waiting:
            held_since = None
        elif holding and all(seq.ready for seq in batch.waiting):
            assert held_since is not None
            _wait_for_arrivals(runner, held_since + BURST_HOLD_SECONDS)


def _observe_step(
    pacer: PrefillPacer,
    seconds: float,
    mixed: list[PrefillResult],
    mixed_before: int,
    pipelined: bool,
) -> int:
    """Tell the pacer what a decode step took: a plain step's time, or with a chunk in its pass
    (`mixed`), that chunk's cost, what the step took past a plain one. Pipelined, a step's time
    is mostly the pass queued a step before (read now), so it costs that pass's chunk
    (`mixed_before`, returned for the next step). A step that carried a chunk or followed one
    is never taken for a plain step: on the H100 the first such step's wait took 80 ms, and as
    a plain step it tripled the pacer's step time, so the chunks' budget."""
    tokens = sum(pre.prefilled for pre in mixed)
    costed, later = (mixed_before, tokens) if pipelined else (tokens, 0)
    if costed:
        pacer.observe_mixed(costed, seconds - (pacer.decode_step or 0.0))
    elif not tokens:
        pacer.observe_decode(seconds)
    return later


def _burst_arriving(runner: Runner, batch: BatchDecoder, lane: MediaLane) -> bool:
    """Whether the sequences ready to join should wait for the rest of a burst: nothing decodes
    (no row, no request with media), and requests are on their way to the runner."""
    if batch.rows or lane or not any(seq.ready for seq in batch.waiting):
        return False
    return runner.arriving > 0


def _wait_for_arrivals(runner: Runner, until: float) -> None:
    """Every waiting sequence is prefilled and held: sleep until a command comes (a job, an
    abort, a stop), no request is on its way any more, or the hold runs out."""
    began = time.perf_counter()
    runner._wakeup.clear()
    if runner._commands.empty() and runner.arriving > 0 and not runner._stop.is_set():
        runner._wakeup.wait(max(0.0, until - began))
    runner.counters.burst_hold_seconds += time.perf_counter() - began


def _padded_prefill(model: Any, block: int, step: int) -> bool:
    """Prefill chunks of recurring shapes (`prefill_shapes`): where it pays (CUDA), with blocks,
    and where this model's padded chunk gives the plain chunk's logits (checked here, once);
    their attention shapes are then warmed (`prefill_shapes.warm_graphs`)."""
    if not padded_prefill_default() or block <= 1:
        return False
    try:
        agrees = padded_prefill_agrees(model, block)
    except Exception as exc:  # the check cannot run: plain chunks serve
        log.warning("prefill chunks stay plain: the padded chunk's check failed (%s)", exc)
        return False
    if not agrees:
        log.warning("prefill chunks stay plain: this model's padded chunk differs from the plain")
        return False
    began = time.perf_counter()
    shapes = warm_graphs(model, block, step)
    log.info("prefill attention shapes warmed: %d in %.1f s", shapes, time.perf_counter() - began)
    return True


def _apply(runner: Runner, batch: BatchDecoder, lane: MediaLane) -> list[SequenceEvent]:
    """Apply every queued command; return the events they cause (a job that cannot start).
    A job with media goes to `lane`, any other to the batch."""
    events: list[SequenceEvent] = []
    block = runner._prefill_plan.block
    while True:
        try:
            command = runner._commands.get_nowait()
        except queue.Empty:
            break
        if isinstance(command, AbortJob):
            if lane.remove(command.request_id, store=command.store):
                runner.counters.aborted += 1
                continue
            seq = batch.remove(command.request_id, keep_cache=command.store)
            if seq is not None:
                runner.counters.aborted += 1
                if command.store and seq.prefill_done and seq.cache is not None:
                    runner._snapshots.store(cast(Any, seq), "conversation")
            continue
        if isinstance(command, ClearSnapshots):
            assert runner._handoff is not None
            runner._handoff.post(command.reply.resolve, runner._snapshots.clear())
            continue
        job = command.job
        try:
            if isinstance(job, MultimodalJob):
                lane.add(job)
            elif runner.scorer is not None and runner.specprefill.applies(
                len(job.prompt_tokens), job.params.specprefill
            ):
                # Approximate: from no cached prefix, and nothing of it is stored.
                batch.add_specprefill(
                    job, runner.scorer, runner.specprefill, runner.specprefill_counters
                )
            else:
                cache, cached_tokens = runner._snapshots.restore_for(job, block)
                batch.add(job, cache, cached_tokens)
            runner.counters.started += 1
        except Exception as exc:
            log.exception("request %d could not start", job.request_id)
            runner.counters.failed += 1
            events.append(
                SequenceEvent(job.request_id, finish="error", error=f"{type(exc).__name__}: {exc}")
            )
    runner.counters.live = batch.live + len(lane)
    return events


def _row_event(
    seq: BatchSequence,
    tokens: tuple[int, ...],
    finish: str | None,
    error: str | None,
    logprobs: tuple[Any, ...] = (),
) -> SequenceEvent:
    reason: FinishReason | None = finish  # type: ignore[assignment]
    return SequenceEvent(seq.request_id, tokens, reason, error, logprobs, seq.cached_tokens)
