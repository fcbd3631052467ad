"""The runner thread's serialized route (`max_num_seqs == 1`, or a model whose cache cannot be
batched): every live sequence steps on its own.

The loop, top to bottom, once per step while anything is live:
1. apply the commands queued since the last step (`_take_commands`): a new job becomes a live
   sequence (an `ActiveSequence` from its restored prefix; a `SpeculativeSequence` with a draft,
   unless a logits processor or a grammar cannot be rewound; a `MultimodalSequence` for a job
   with media, whose first step is its vision encoding, or a `DraftedMultimodalSequence` for
   one that an mlx-vlm drafter decodes; a `SpecPrefillSequence` for a long prompt
   when a scoring model is loaded, from no cached prefix and storing nothing); an abort takes its
   sequence out and, when asked to and its prefill completed, snapshots what its cache holds;
   `ClearSnapshots` is answered at once;
2. one step of each live sequence, in the order they started: a prefill chunk under the pacer's
   budget (`PrefillPacer`, fed the chunk's measured time) or one decode token (several with a
   draft). A sequence whose step raises fails alone (`finish="error"`); the others go on;
3. the step's events and snapshots (the store points its prefill chunks reached, the caches of
   the sequences that finished, unless a sequence's cache is not safe to snapshot) go out
   through `Runner._emit`: tokens first, finishes after the snapshots.

The protocol with Trio is the runner's (see `runner`): one `SequenceEvent` batch per step posted
to the runner's `Handoff`, `Runner.submit` / `Runner.abort` / `TokenSink.push` unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from trio_mlx.actors.kv_cache import CacheKind
from trio_mlx.actors.runner_protocol import AbortJob, ClearSnapshots, SequenceEvent
from trio_mlx.engine.decode import ActiveSequence
from trio_mlx.engine.loading import LoadedModel
from trio_mlx.engine.specprefill import SpecPrefillSequence
from trio_mlx.engine.speculative_sequence import SpeculativeSequence
from trio_mlx.multimodal.drafted import DraftedMultimodalSequence
from trio_mlx.multimodal.job import MultimodalJob, MultimodalSequence
from trio_mlx.types import FinishReason

if TYPE_CHECKING:
    from trio_mlx.actors.runner import Runner

log = logging.getLogger(__name__)

#: What the serialized route steps: a text sequence, one with a draft, one with media, or a long
#: prompt's sparse prefill.
LiveSequence = (
    ActiveSequence
    | SpeculativeSequence
    | MultimodalSequence
    | DraftedMultimodalSequence
    | SpecPrefillSequence
)


def serve_serialized(runner: Runner, loaded: LoadedModel) -> None:
    """The serialized route: each live sequence steps on its own (`ActiveSequence`)."""
    live: dict[int, LiveSequence] = {}
    counters = runner.counters
    pacer = runner.pacer
    while True:
        if runner._stop.is_set() or (not live and not runner._wait_for_command()):
            return
        events = _take_commands(runner, live, loaded)
        if not live:
            runner._emit(events, [])
            continue
        began = time.perf_counter()
        stores: list[tuple[Any, CacheKind, int | None]] = []
        for request_id, seq in list(live.items()):
            prefill = seq.in_prefill
            try:
                chunk_began = time.perf_counter()
                result = seq.step(pacer.chunk_tokens() if prefill else None)
                if prefill and not result.tokens and result.finish is None:
                    pacer.observe_chunk(result.prefilled, time.perf_counter() - chunk_began)
            except Exception as exc:
                log.exception("request %d failed inside the model", request_id)
                del live[request_id]
                counters.failed += 1
                events.append(
                    SequenceEvent(
                        request_id,
                        finish="error",
                        error=f"{type(exc).__name__}: {exc}",
                        cached_tokens=seq.cached_tokens,
                    )
                )
                continue
            counters.prompt_tokens += result.prefilled
            if prefill and not result.tokens and result.finish is None:
                counters.prefill_chunks += 1
            else:
                counters.decode_steps += 1
            counters.generated_tokens += len(result.tokens)
            last = len(seq.job.prompt_tokens) - 1
            for point in result.store_points:  # none from a SpecPrefill sequence
                stores.append((seq, "prompt" if point == last else "system", point))
            if result.finish is not None:
                del live[request_id]
                stores.append((seq, "conversation", None))
            if result.tokens or result.finish is not None:
                finish: FinishReason | None = result.finish  # type: ignore[assignment]
                events.append(
                    SequenceEvent(
                        request_id,
                        result.tokens,
                        finish,
                        None,
                        result.logprobs,
                        seq.cached_tokens,
                    )
                )
        counters.steps += 1
        counters.live = len(live)
        runner._emit(events, stores)
        counters.busy_seconds += time.perf_counter() - began


def _take_commands(
    runner: Runner, live: dict[int, LiveSequence], loaded: LoadedModel
) -> list[SequenceEvent]:
    """Apply every queued command; return the events they cause (a job that cannot start)."""
    events: list[SequenceEvent] = []
    vocab_size = runner.info.vocab_size if runner.info is not None else len(loaded.tokenizer)
    support = runner.info.cache_support if runner.info is not None else None
    trimmable = support is not None and support.trimmable
    plan = runner._prefill_plan
    while True:
        try:
            command = runner._commands.get_nowait()
        except queue.Empty:
            break
        if isinstance(command, AbortJob):
            seq = live.pop(command.request_id, None)
            if seq is not None:
                runner.counters.aborted += 1
                if command.store and seq.prefill_done:
                    runner._snapshots.store(seq, "conversation")
            continue
        if isinstance(command, ClearSnapshots):
            assert runner._handoff is not None
            runner._handoff.post(command.reply.resolve, runner._snapshots.clear())
            continue
        job = command.job
        try:
            if isinstance(job, MultimodalJob):
                live[job.request_id] = runner._multimodal_sequence(job, loaded, vocab_size)
                runner.counters.started += 1
                continue
            if runner.scorer is not None and runner.specprefill.applies(
                len(job.prompt_tokens), job.params.specprefill
            ):
                # Approximate: from no cached prefix, and nothing of it is stored.
                live[job.request_id] = SpecPrefillSequence(
                    job,
                    loaded.model,
                    runner.scorer,
                    runner.specprefill,
                    runner.specprefill_counters,
                    loaded.eos_token_ids,
                    vocab_size=vocab_size,
                    chunk_tokens=plan.step,
                )
                runner.counters.started += 1
                continue
            cache, cached_tokens = runner._snapshots.restore_for(job, plan.block)
            # A processor's or a grammar's state cannot be rewound: such requests decode
            # without the draft.
            rewindable = not job.logits_processors and job.grammar is None
            speculator = runner.speculator if rewindable else None
            make = (
                partial(ActiveSequence, compiled=runner.compiled or runner.lean)
                if speculator is None
                else partial(SpeculativeSequence, speculator)
            )
            live[job.request_id] = make(
                job,
                loaded.model,
                loaded.eos_token_ids,
                plan if cached_tokens % plan.block == 0 else dataclasses.replace(plan, block=1),
                vocab_size=vocab_size,
                max_kv_size=runner._max_kv_size,
                cache=cache,
                cached_tokens=cached_tokens,
                split_at_store_points=not trimmable,
            )
            runner.counters.started += 1
        except Exception as exc:
            log.exception("request %d could not start", job.request_id)
            runner.counters.failed += 1
            events.append(
                SequenceEvent(job.request_id, finish="error", error=f"{type(exc).__name__}: {exc}")
            )
    runner.counters.live = len(live)
    return events
