"""Sequences on their way into the decode batch: prefilled, then joined. Runs on the runner
thread only, for `BatchDecoder.prefill` / `BatchDecoder.join`.

A sequence admitted to the batch (`BatchDecoder.add`) waits in `BatchDecoder.waiting`,
prefilling on a cache of its own (restored from the prefix cache, or fresh) one chunk at a time
under the runner's budget (`prefill`). It is ready once every prompt token but the last is in
its cache; the runner then takes its prefill's snapshots, and it joins (`joined`): its cache is
merged into the batch's (mlx-lm's `BatchKVCache` / `BatchRotatingKVCache`, left-padded: plain
layers in one new buffer with room to grow, `batch_layout`; others by their classes' `merge` /
`extend`), and its last prompt token is its input to the next step, whose logits give its first
token. (A sequence with media alone in the batch takes its first token from its prompt's last
pass instead, `batch_lone_media`: it is ready with that token as its `pending` input, which is
then its input to the next step.)

`prefill` spends a budget of prompt tokens and seconds: with `group`, first a chunk each for the
sequences older than every one that could be grouped (so that newer arrivals never overtake them),
then the short prompts of several arrivals together in one pass where they can (`batch_prefill`);
then, in admission order, a chunk each (`BatchSequence.prefill_chunk`; a prompt with media through
its own `prefill_model`, `multimodal.joining`; a SpecPrefill row's scoring chunk or sparse prefill
chunk, `batch_specprefill`: a scoring chunk's tokens spend the budget too, and are reported as
`scored`, not prefilled).

`joined` by the batch it joins (ready sequences join in admission order, after the batch's rows):
- an empty batch and one joiner, with solo rows: the joiner's own cache becomes the batch's cache
  as it is (a lone row, `BatchDecoder.solo`: its step is the serialized route's forward pass);
- an empty batch, or a lone row on its own cache: one new batch cache merged from the lone row's
  cache (first) and the joiners' (`batch_layout.merged`);
- a batch cache: the joiners' caches appended to it as rows (`batch_layout.extend`).
With `segments`, rows of very different lengths go in groups of their own, each on its own
buffer (`batch_segments`: a long prompt joining short rows re-lays none of theirs).
Each keeps the batch cache's `aligned` fact (`batch_mask`) from lengths known on the host. A
SpecPrefill row's cache (`PositionedKVCache` layers) merges as a plain one whose RoPE position
runs past what it stores: its row's `offset` is its true position (`batch_layout`).

Errors: a prefill chunk that raises fails that sequence only (it leaves `waiting`); a group pass
that raises fails none of them, since it cannot say whose prompt it was: each then prefills alone
(their caches are as they were), and the failure is counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from trio_mlx.engine import batch_layout, batch_mask, batch_segments
from trio_mlx.engine.batch_prefill import can_group, choose_group, prefill_together
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.decode import PrefillPlan
from trio_mlx.types import TokenLogprob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    """One prefill chunk of one sequence (or its failure)."""

    seq: BatchSequence
    prefilled: int = 0
    store_points: tuple[int, ...] = ()
    error: str | None = None
    #: prefilled in one pass with other arrivals (`batch_prefill`), not a chunk of its own
    grouped: bool = False
    #: prompt tokens through the scoring model in this chunk (a SpecPrefill row still being
    #: scored, `batch_specprefill`: then `prefilled` is 0, nothing went through the target)
    scored: int = 0
    #: the pass gave the sequence's first token (a sequence with media alone in the batch,
    #: `batch_lone_media`): the token, unless it was an EOS, its finish, if it ended there, and
    #: its logprobs
    tokens: tuple[int, ...] = ()
    finish: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    first_token: bool = False


def prefill(
    model: Any,
    waiting: list[BatchSequence],
    plan: PrefillPlan,
    tokens: int,
    seconds: float,
    *,
    group: bool,
    bucketed: bool = False,
    rungs: bool = False,
) -> tuple[list[PrefillResult], bool]:
    """Prefill `waiting` sequences until `tokens` prompt tokens or `seconds` are spent (module
    docstring; `bucketed`: a group pass takes a bucketed shape, `batch_prefill`); a sequence
    whose chunk raises leaves `waiting`. Return the results and whether a group pass raised.
    `rungs`: rows are decoding, every chunk is a rung of the ladder (`prefill_chunk`).

    With `group`, the sequences older than every one that could be grouped (a prompt longer
    than a chunk, one with media) take their chunks first, so that groups of newer arrivals
    never take the budget they wait for; then the group; then a chunk each for the rest, in
    admission order."""
    results: list[PrefillResult] = []
    group_failed = False
    began = time.perf_counter()
    chunked: set[int] = set()  # ids of the sequences given their chunk in this call

    def chunks(sequences: Sequence[BatchSequence]) -> None:
        nonlocal tokens
        for seq in list(sequences):
            if tokens <= 0 or time.perf_counter() - began >= seconds:
                return
            if seq.ready or id(seq) in chunked:
                continue
            chunked.add(id(seq))
            result = _chunk(model, seq, tokens, rungs)
            if result.error is not None:
                waiting.remove(seq)
            tokens -= result.prefilled + result.scored
            results.append(result)

    if group:
        head = next((i for i, s in enumerate(waiting) if can_group(s, plan.step)), len(waiting))
        chunks(waiting[:head])
        rest = [s for s in waiting if id(s) not in chunked]
        chosen = choose_group(rest, tokens, plan.step, plan.block) if tokens > 0 else []
        if chosen:
            try:
                step = plan.step if bucketed and plan.block > 1 else None
                done = prefill_together(model, chosen, plan.block, bucketed_up_to=step)
            except Exception as exc:
                # Not attributable to one of them: each prefills alone below, where a failure
                # fails only its own sequence (their caches are as they were).
                group_failed = True
                log.warning(
                    "a prefill pass of %d arrivals failed (%s: %s); they prefill one by one",
                    len(chosen),
                    type(exc).__name__,
                    exc,
                )
            else:
                for seq, (n, points) in zip(chosen, done, strict=True):
                    tokens -= n
                    results.append(PrefillResult(seq, n, points, grouped=True))
    chunks(waiting)
    return results, group_failed


def _chunk(model: Any, seq: BatchSequence, tokens: int, rungs: bool) -> PrefillResult:
    """One prefill chunk of `seq` of at most `tokens` tokens: what it prefilled (a scoring
    chunk's tokens as `scored`: they spend the budget too, whatever model), or its error."""
    scoring = seq.scoring
    try:
        n, points = seq.prefill_chunk(seq.prefill_model or model, tokens, rungs=rungs)
    except Exception as exc:
        return PrefillResult(seq, error=f"{type(exc).__name__}: {exc}")
    seq.chunks_run += 1
    return PrefillResult(seq, scored=n) if scoring else PrefillResult(seq, n, points)


def joined(
    joiners: Sequence[BatchSequence],
    cache: list[Any],
    inputs: Any,
    *,
    empty: bool,
    solo: bool,
    solo_rows: bool,
    segments: bool = False,
) -> tuple[list[Any], Any, bool]:
    """The batch's cache, its next step's inputs and whether it is a lone row on its own cache,
    once `joiners` (ready, in order) join a batch (`empty`, else on `cache` with `inputs`, a lone
    row's own cache when `solo`); with `solo_rows` a lone joiner into an empty batch keeps its own
    cache (module docstring); with `segments` rows of very different lengths go in groups of
    their own (`batch_segments`). Takes each joiner's cache (`seq.cache` becomes None); a batch
    cache is extended in place."""
    caches: list[list[Any]] = []
    for seq in joiners:
        assert seq.cache is not None
        caches.append(seq.cache)
    # each joiner's input: its last prompt token, or its first token where its prompt's last
    # pass gave it (`batch_lone_media`: its `pending` input)
    last = mx.array(
        [s.job.prompt_tokens[-1] if s.pending is None else s.pending for s in joiners],
        dtype=mx.uint32,
    )
    for seq in joiners:
        seq.cache = None
    if empty and len(joiners) == 1 and solo_rows:
        return caches[0], last, True
    if empty or solo:
        # A new batch, or the lone row and the joiners merged into one.
        if solo:
            caches.insert(0, cache)
            last = mx.concatenate([inputs, last])
        lengths = [batch_mask.sequence_length(c) for c in caches]
        grouped = batch_segments.merged(caches, lengths) if segments else None
        if grouped is not None:
            return grouped, last, False
        merged = batch_layout.merged(caches)
        batch_mask.adopt(merged, batch_mask.aligned_after_merge(lengths))
        return merged, last, False
    lengths = [batch_mask.sequence_length(c) for c in caches]
    if (segments or batch_segments.segmented(cache)) and batch_segments.extend(
        cache, caches, lengths
    ):
        return cache, mx.concatenate([inputs, last]), False
    joiners_aligned = batch_mask.aligned_after_merge(lengths)
    aligned = batch_mask.aligned_after_extend(cache, lengths[0] if joiners_aligned else None)
    batch_layout.extend(cache, caches)
    batch_mask.adopt(cache, aligned)
    return cache, mx.concatenate([inputs, last]), False
