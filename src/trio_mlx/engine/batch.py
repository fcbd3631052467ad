"""Continuous batching: many sequences decoding together, one forward pass per step. Runs on the
runner thread only.

`BatchDecoder` holds two groups of `BatchSequence`s (`batch_sequence`):
- `waiting`: admitted, prefilling on a cache of their own (restored from the prefix cache or
  fresh), one chunk at a time under the runner's budget (`prefill`), until every prompt token
  but the last is in its cache (a long prompt under SpecPrefill, `add_specprefill`: scored, then
  its kept tokens prefilled at their true positions, `batch_specprefill`);
- `rows`: the decode batch, on the batch's cache (mlx-lm's `BatchKVCache` /
  `BatchRotatingKVCache`, left-padded; rows leave it by the cache classes' `filter` / `extract`,
  `batch_leave`).
  Ready sequences join it (`join`): their caches merged into the batch's, their last prompt token
  their input to the next step, whose logits give their first token. How sequences prefill
  and join: `batch_join`.

A lone row keeps its own cache (`solo`): while one sequence decodes, the batch's cache is that
sequence's prompt cache as it prefilled it (mlx-lm's `KVCache` and kin, an integer offset), so
its step is the serialized route's forward pass exactly: no batch mask, RoPE at an integer
offset, no per-layer offset arrays. Measured on the H200 the batch cache's lone row decoded at
0.64-0.74x the serialized route (before its mask was dropped); the GPU serves with batching on by
default, so one user alone must not pay for it. A second row joining merges the lone cache into a
batch cache with the joiners' (`merge`); the batch falling back to one row extracts that row's
cache again (`extract`, one copy of its keys and values). A request with media alone in the batch
goes further, to its media lane's path (`lone_media`, `batch_lone_media`): its first token from
its prompt's last pass, read at once, and while it decodes alone, its steps through its own model
(the language model at its rope delta, as its lane calls it).

With `lean` (the model's `lean_step.LeanStep`) a lone row decodes through the lean one-token step
on its own cache; with `TRIO_MLX_LEAN_BATCH=on` too, a batch of 2 or more rows through
`LeanStep.batch_logits` over the batch's cache, where no traced step serves (the model's own calls
in fewer graph nodes: the same logits on the CPU; not yet measured on a GPU, hence off).

With `compiled` (the model's `compiled_step.CompiledDecode`) the batch's forward pass is the
traced batch step wherever the batch's cache fits it (`CompiledDecode.batch_fits`) and, with
`compiled_rows`, the batch holds from 2 to `compiled_rows` rows (small batches, where a step is
bound by the host building it: a lone row keeps its own cache, larger batches and passes that
carry prompt chunks take the plain step); without `compiled_rows`, at every size, a lone row
then staying in the batch cache, which that step takes.

`decode()` is one step for every row: rows removed since the last step (finished, aborted,
failed) leave the batch (`batch_leave`); the next step's forward pass is queued on the device
(`mx.async_eval`); then the previous step's tokens are read and returned, so the device computes
step k while the host reads step k - 1. Where that does not pay (`pipelined` False: MLX's CPU
backend), each step is read as soon as it is queued. The step, its read and its token
accounting: `batch_step`.

Per sequence, as on the serialized route (`decode.ActiveSequence`): its own token choice
(`batch_choice`: its sampling, processors, logit bias and logprobs; plain greedy rows by one
batched argmax), its EOS set and `max_tokens`; a row continuing a prompt with media, its own
positions (`BatchSequence.rope_delta`, `multimodal.joining`).

Rows of very different lengths (a long prompt joined short ones) sit in groups of their own, each
on its own buffer (`batch_segments`: a long row joins and leaves without re-laying the others'
caches); within one buffer, rows of very different lengths attend in two groups, the short rows
over only the columns they use (`ragged_attention`), not every row over the longest's width.

Constrained rows (a job with a `grammar`: each row its own `GrammarMatcher`) are chosen after
the previous step is read, their masks computed while the device runs the step
(`batch_constrained`); a batch with one row may take speculative steps instead of `decode`
(`batch_speculate`).

Errors: a prefill chunk that raises fails that sequence only; a processor or sampler that raises
fails its row only; the batched forward pass raising (or its evaluation) fails every row in it,
the only requests it can be attributed to, and the batch starts again empty.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import mlx.core as mx

from trio_mlx.engine import batch_join, batch_segments, mixed_step, ragged_attention
from trio_mlx.engine.batch_choice import BatchChoice
from trio_mlx.engine.batch_constrained import choose_constrained
from trio_mlx.engine.batch_join import PrefillResult
from trio_mlx.engine.batch_jump import can_jump, jump_row
from trio_mlx.engine.batch_leave import failed, left, row_cache
from trio_mlx.engine.batch_lone_media import (
    alone_with_media,
    first_token_pass,
    fits_first_pass,
    lone_step_model,
)
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.batch_specprefill import SpecPrefillRow
from trio_mlx.engine.batch_speculate import can_speculate, speculate_row
from trio_mlx.engine.batch_step import (
    QueuedStep,
    RowResult,
    feed,
    forward,
    pipelining_pays,
    queue_tokens,
    read_step,
    spent_rows,
)
from trio_mlx.engine.compiled_step import COMPILABLE_MODULES, CompiledDecode
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.decode_attention import install_dispatcher
from trio_mlx.engine.dispatch_order import DispatchOrder
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.engine.padded_attention import padded_attention_default
from trio_mlx.engine.prefill_shapes import padded_prefill_default
from trio_mlx.engine.ragged_attention import RaggedPlan
from trio_mlx.engine.specprefill import SpecPrefillCounters, SpecPrefillSettings
from trio_mlx.engine.speculative import Speculator

__all__ = ["BatchDecoder", "RowResult"]


class BatchDecoder:
    """The decode batch and the sequences waiting to join it (see the module docstring)."""

    #: a lone row decodes on its own cache (module docstring); False keeps it in a batch cache
    #: like any other row (what `bench.lone_row` measures against)
    solo_rows = True
    #: a lone greedy row under a grammar feeds its forced runs in one pass (`batch_jump`)
    jump_forward = True
    #: a sequence with media alone in the batch takes its lane's path (`batch_lone_media`): its
    #: first token from its prompt's last pass, its steps through its own model. False: it
    #: prefills, joins and decodes as any row (what `bench.media_lone` measures against)
    lone_media = True
    #: several arrivals' short prompts prefill in one pass (`batch_prefill`). None: where it
    #: was measured to pay, with the prefill chunks' recurring shapes (`padded_prefill`, MLX's
    #: CUDA backend): a 16-request burst's first tokens in half the time on the H100
    #: (`bench.burst`, docs/benchmarks); not on the CPU, where a pass costs by its tokens and
    #: grouping did not pay. True / False: on / off whatever the backend
    group_prefill: bool | None = None
    #: a batch of rows of very different lengths attends in two groups, the short rows over
    #: only the columns they use (`ragged_attention`); False: every row over the whole width
    ragged_attention = True
    #: rows of very different lengths sit in groups of their own, each on its own buffer: a
    #: long prompt joins and leaves without re-laying the other rows' caches (`batch_segments`);
    #: False: one buffer a layer, every row at the longest row's width
    segmented_rows = True
    #: waiting prompts' next chunks ride in the decode step's forward pass (`mixed_step`,
    #: `decode`'s `mix`). None: where it was measured to pay, with the prefill chunks' recurring
    #: shapes (MLX's CUDA backend: on an H100's 8B, 16 streams' gaps while an 8,000-token prompt
    #: was admitted, p50 14 ms against 26 with the chunks apart, p99 59-64 against 70-78;
    #: docs/benchmarks), not on the CPU, where a pass has no fixed cost to share;
    #: `TRIO_MLX_MIXED_STEP=on|off` decides instead where set. True / False: on / off
    mixed_prefill: bool | None = None

    def __init__(
        self,
        model: Any,
        eos_token_ids: frozenset[int],
        *,
        vocab_size: int,
        plan: PrefillPlan,
        max_kv_size: int | None = None,
        split_at_store_points: bool = True,
        compiled: CompiledDecode | None = None,
        compiled_rows: int | None = None,
        padded_prefill: bool | None = None,
        pipelined: bool | None = None,
        lean: LeanStep | None = None,
    ) -> None:
        self._model = model
        #: the next step is queued before the last one is read (None: where that pays,
        #: `pipelining_pays`); else each step is read as soon as it is queued
        self.pipelined = pipelining_pays() if pipelined is None else pipelined
        self._compiled = compiled  # the traced batch step, where the batch's cache fits it
        #: the most rows the traced step takes (None: any number, a lone row's included)
        self._compiled_rows = compiled_rows
        #: the traced step at every size, a lone row included (in the batch cache)
        every_size = compiled is not None and compiled_rows is None
        #: a lone row on its own cache, except where the traced step wants a batch cache
        self._solo_rows = self.solo_rows and not every_size
        #: decode steps that took the traced batch step
        self.traced_steps = 0
        #: the lone row's one-token step, on its own cache (`lean_step`; None: the model's)
        self._lean = lean
        #: the lean step for batches of 2 or more rows too: `TRIO_MLX_LEAN_BATCH=on`, an
        #: experiment until measured on a GPU (module docstring)
        self._lean_batch = (
            lean is not None and os.environ.get("TRIO_MLX_LEAN_BATCH", "").lower() == "on"
        )
        self._eos = eos_token_ids
        self._vocab = vocab_size
        self._plan = plan
        self._max_kv_size = max_kv_size
        self._split = split_at_store_points
        self.waiting: list[BatchSequence] = []
        self.rows: list[BatchSequence] = []
        #: the batch's cache, one entry a layer: the lone row's own cache while `solo`, else the
        #: rows' merged batch cache (mlx-lm's `BatchKVCache` and kin)
        self._cache: list[Any] = []
        self.solo = False
        self._inputs: Any = None
        self._queued: QueuedStep | None = None
        #: whether a step built is queued at once or after the tokens read before it are
        #: handed over (`dispatch_order`; pipelined only)
        self.dispatch_order = DispatchOrder() if self.pipelined else DispatchOrder("off")
        self._choice = BatchChoice(vocab_size)
        self.steps = 0
        #: of the sequences the last `join` let in, how many took their last prompt token as
        #: their input (the others, their first token: `batch_lone_media`)
        self.joined_prompt_tokens = 0
        #: group prefill passes that raised (their sequences then prefilled one by one)
        self.group_failures = 0
        self._pad_runs = padded_attention_default()  # jump passes padded to one shape (CUDA)
        #: prefill chunks of recurring attention shapes (`prefill_shapes`; None: the default)
        self._padded_prefill = (
            padded_prefill_default() if padded_prefill is None else padded_prefill
        )
        self._ragged: RaggedPlan | None = None  # the last step's (`ragged_attention`)
        #: decode steps whose rows attended in two groups
        self.grouped_attention_steps = 0
        #: decode steps whose rows sat in groups of their own (`batch_segments`)
        self.segmented_steps = 0
        #: rows of very different lengths go in groups of their own (`batch_segments`;
        #: `TRIO_MLX_SEGMENTED_ROWS=off` turns it off where set, for benchmarks)
        segments = os.environ.get("TRIO_MLX_SEGMENTED_ROWS", "").lower() != "off"
        self._segments = self.segmented_rows and segments and batch_segments.supported(model)
        #: joins put off by a step (`join`'s `defer_long`)
        self.deferred_joins = 0
        mixing = self.mixed_prefill
        if mixing is None:
            chosen = os.environ.get("TRIO_MLX_MIXED_STEP", "").lower()
            mixing = chosen == "on" if chosen in ("on", "off") else self._padded_prefill
        #: decode steps can carry a prefill chunk (`mixed_step`: on and the model takes it)
        self.mixing = bool(mixing) and not every_size and mixed_step.prepare(model)
        #: prefill chunks that rode in a decode step, and those of the last `decode` (taken by
        #: `take_mixed`)
        self.mixed_chunks = 0
        self._mixed: list[PrefillResult] = []
        if self.ragged_attention or self._segments:
            install_dispatcher(COMPILABLE_MODULES)
        if self.ragged_attention and padded_attention_default():
            ragged_attention.warm_up(model)  # CUDA compiles the groups' gathers on first use

    # ---- membership ---------------------------------------------------------------------------

    def add(self, job: GenerationJob, cache: list[Any] | None, cached_tokens: int) -> BatchSequence:
        """Admit `job` (from a restored `cache` holding `cached_tokens`, or fresh) to prefill."""
        seq = self.sequence(job, cache, cached_tokens)
        self.waiting.append(seq)
        return seq

    def sequence(
        self,
        job: GenerationJob,
        cache: list[Any] | None,
        cached_tokens: int,
        key_tokens: tuple[int, ...] | None = None,
    ) -> BatchSequence:
        """A sequence of this batch for `job`, not admitted: with `key_tokens` (a prompt with
        media, prefilled by `multimodal.joining` and admitted by `admit` once ready), chunks of
        any size (its embeddings end with the prompt: no padded shapes)."""
        media = key_tokens is not None
        return BatchSequence(
            job,
            self._model,
            vocab_size=self._vocab,
            plan=PrefillPlan(self._plan.step, self._plan.tail) if media else self._plan,
            max_kv_size=self._max_kv_size,
            cache=cache,
            cached_tokens=cached_tokens,
            split_at_store_points=self._split,
            padded=self._padded_prefill and not media,
            key_tokens=key_tokens,
        )

    def add_specprefill(
        self,
        job: GenerationJob,
        scorer: Any,
        settings: SpecPrefillSettings,
        counters: SpecPrefillCounters,
    ) -> BatchSequence:
        """Admit `job` (a long prompt, `settings.applies`) to a sparse prefill scored by `scorer`
        (`batch_specprefill`): from no cached prefix, storing nothing."""
        seq = SpecPrefillRow(
            job, self._model, scorer, settings, counters, vocab_size=self._vocab, plan=self._plan
        )
        self.waiting.append(seq)
        return seq

    def admit(self, seq: BatchSequence) -> None:
        """Admit a sequence prefilled elsewhere (`sequence`); it joins at the next `join`."""
        self.waiting.append(seq)

    def remove(self, request_id: int, *, keep_cache: bool = False) -> BatchSequence | None:
        """Take `request_id` out: at once if it is prefilling, at the next step if it is a row.
        With `keep_cache`, a row's cache is extracted first (for a snapshot)."""
        for i, seq in enumerate(self.waiting):
            if seq.request_id == request_id:
                del self.waiting[i]
                return seq
        for i, seq in enumerate(self.rows):
            if seq.request_id == request_id and not seq.removed:
                seq.removed = True
                if keep_cache and seq.prefill_done:
                    seq.cache = self._extract(i)
                return seq
        return None

    @property
    def live(self) -> int:
        return len(self.waiting) + sum(1 for s in self.rows if not s.removed)

    @property
    def decoding(self) -> int:
        """Rows that will take part in the next step."""
        return sum(1 for s in self.rows if not s.removed)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.rows or self._queued)

    def kv_bytes(self) -> int:
        """Memory of the batch's cache and the waiting sequences' own caches."""
        total = sum(int(c.nbytes) for c in self._cache)
        for seq in self.waiting:
            if seq.cache is not None:
                total += sum(int(c.nbytes) for c in seq.cache)
        return total

    # ---- decode -------------------------------------------------------------------------------

    def decode(self, mix: int = 0) -> list[RowResult]:
        """One step: drop removed rows, queue the next forward pass, read the previous one; not
        `pipelined`, read the step just queued as well (module docstring). `mix`: where the
        batch is `mixing`, waiting sequences' next chunks of `mix` tokens in all ride in the
        pass (`_mixed_pass`); their results are then taken by `take_mixed`. Where
        `dispatch_order` defers, the pass is built but queued only by `dispatch_pending`, which
        the caller runs once it has handed the results over (else the next call does)."""
        self.dispatch_pending()
        self._drop_removed()
        try:
            queued = self._queue_step(mix) if self.rows else None
            results = self._read(self._queued) if self._queued is not None else []
            if queued is not None and queued.tokens is None:
                self._inputs = choose_constrained(queued, self._choice.row)
            self._queued = queued
            if queued is not None and not self.pipelined:
                self._queued = None
                results += self._read(queued, fed=False)
        except Exception as exc:
            return self._fail_batch(exc)
        return results

    def dispatch_pending(self) -> None:
        """Queue on the device the step `decode` built without queuing (`dispatch_order`)."""
        if self._queued is not None and not self._queued.dispatched:
            # what queuing it raises, its read raises again (evaluating it), failing the batch
            with contextlib.suppress(Exception):
                self._queued.dispatch()

    def _queue_step(self, mix: int = 0) -> QueuedStep:
        """Queue the next step's forward pass and its choice of tokens (`batch_step`), with
        waiting sequences' chunks of `mix` tokens in all in it where they can (`_mixed_pass`)."""
        rows = list(self.rows)
        spent = spent_rows(rows, self._queued)
        feed(rows)
        segmented = batch_segments.segmented(self._cache)
        self.segmented_steps += segmented
        own = lone_step_model(rows, solo=self.solo) if self.lone_media else None
        traced = self._traced_step(rows) if own is None and not mix else None
        if self.ragged_attention and not self.solo and not segmented and traced is None:
            # the positions each row holds once this step has written: a row whose previous
            # step is in flight (not yet read) has that step's token still to count
            in_flight = {id(seq) for seq in self._queued.rows} if self._queued else set()
            lengths = [seq.cached_length + (id(seq) in in_flight) for seq in rows]
            self._ragged = ragged_attention.prepare(self._cache, lengths, self._ragged)
            self.grouped_attention_steps += self._ragged is not None
        logits = self._mixed_pass(rows, mix) if mix and own is None else None
        if logits is None:
            if traced is None and mix:  # no chunk rode in the pass after all
                traced = self._traced_step(rows) if own is None else None
            lean = self._lean if self.solo and own is None else None
            lean_rows = self._lean if self._lean_batch and own is None else None
            logits = forward(
                self._model,
                rows,
                self._inputs,
                self._cache,
                own=own,
                compiled=traced,
                lean=lean,
                lean_rows=lean_rows,
            )
            self.traced_steps += traced is not None
        # No periodic `mx.clear_cache()` (mlx-lm's generate clears every 256 tokens): the
        # batched route bounds MLX's buffer cache instead (`batch_loop.BATCH_CACHE_LIMIT`), and
        # a step after a clear allocates every buffer anew: on an H100's 8B, 16 rows, the steps
        # at each 256th took 48-80 ms against 9-15 (`bench.long_arrival --trace-chunks`).
        self.steps += 1
        queued = queue_tokens(rows, logits, self._choice, spent, order=self.dispatch_order)
        if queued.tokens is not None:
            self._inputs = queued.tokens
        return queued

    def _traced_step(self, rows: list[BatchSequence]) -> CompiledDecode | None:
        """The traced batch step where this step's rows may take it: the batch's cache fits
        it, no row is at a rope delta and, with `compiled_rows`, there are at most that many."""
        compiled = self._compiled
        if compiled is None or not compiled.batch_fits(self._cache):
            return None
        if self._compiled_rows is not None and len(rows) > self._compiled_rows:
            return None
        return None if any(seq.rope_delta for seq in rows) else compiled

    def _mixed_pass(self, rows: list[BatchSequence], limit: int) -> Any:
        """The step's logits from one pass with waiting sequences' next chunks in it, `limit`
        prompt tokens in all (`mixed_step.choose_chunks`, `mixed_step.forward`), or None where
        none can share it. A pass that raises fails those sequences too (they leave `waiting`;
        their results say why), and every row (`decode`)."""
        if not self.mixing or any(seq.rope_delta for seq in rows):
            return None
        chunks = mixed_step.choose_chunks(
            self.waiting, self._cache, limit, grouping=self._grouping(), step=self._plan.step
        )
        if not chunks:
            return None
        try:
            logits, done = mixed_step.forward(self._model, self._inputs, self._cache, chunks)
        except Exception as exc:
            for chunk in chunks:
                self.waiting.remove(chunk.seq)
                self._mixed.append(PrefillResult(chunk.seq, error=f"{type(exc).__name__}: {exc}"))
            raise
        for chunk, (n, points) in zip(chunks, done, strict=True):
            chunk.seq.chunks_run += 1
            self._mixed.append(PrefillResult(chunk.seq, n, points))
        self.mixed_chunks += len(chunks)
        return logits

    def take_mixed(self) -> list[PrefillResult]:
        """The prefill chunks the last `decode` carried (`mix`), once."""
        mixed, self._mixed = self._mixed, []
        return mixed

    def _read(self, queued: QueuedStep, *, fed: bool = True) -> list[RowResult]:
        """The tokens of a queued step (`batch_step.read_step`); `fed`: the step after it is
        queued already (so they are in the cache), else each row's token is its `pending` input."""
        if self.dispatch_order.watches and queued.tokens is not None and queued.dispatched:
            began = time.perf_counter()
            mx.eval(queued.tokens)  # (read_step's own eval then finds it done)
            self.dispatch_order.observe(time.perf_counter() - began)
        return read_step(
            queued, eos=self._eos, choice=self._choice, finish_row=self._finish_row, fed=fed
        )

    def _read_for_lone_row(self) -> tuple[list[RowResult], BatchSequence | None]:
        """Read the step already queued, if any, without queuing another (a row's token read
        becomes its `pending` input, not yet fed); return its results and the batch's only live
        row when it has a pending input (else None: several rows, or it ended). Raises what the
        read raises."""
        self._drop_removed()
        results: list[RowResult] = []
        if self._queued is not None:
            results = self._read(self._queued, fed=False)
            self._queued = None
        live = [s for s in self.rows if not s.removed]
        if len(live) != 1 or live[0].pending is None:
            return results, None
        return results, live[0]

    # ---- jump-forward for a lone constrained row ----------------------------------------------

    def can_jump(self) -> bool:
        """One row decodes, on its own cache, under a grammar that forced its last token, greedy
        with nothing but its mask shaping the choice (`batch_jump.can_jump`), a step queued:
        `jump` may replace `decode`."""
        if self._queued is not None:
            stepped = self._queued.tokens is not None
        else:  # not pipelined: the step was read, the row's token is its pending input
            stepped = any(s.pending is not None for s in self.rows if not s.removed)
        return self.jump_forward and stepped and can_jump(self.rows, self._cache, solo=self.solo)

    def jump(self) -> list[RowResult]:
        """One jump-forward step for the batch's only row, instead of `decode`
        (`batch_jump`): the queued step is read without queuing another, then the row's pending
        token and the run its grammar forces after it go through the model in one pass, and the
        next token is queued. The row's result carries the token read and the run."""
        try:
            results, seq = self._read_for_lone_row()
        except Exception as exc:
            return self._fail_batch(exc)
        if seq is None:
            return results
        try:
            out = jump_row(seq, self._model, self._cache, self._vocab, self._pad_runs)
        except Exception as exc:
            return results + self._fail_batch(exc)
        for i, read in enumerate(results):
            if read.seq is seq:  # the token read, then the run
                results[i] = RowResult(seq, (*read.tokens, *out.run), out.finish)
                break
        else:  # not pipelined: its token was read (and returned) by the last `decode`
            results.append(RowResult(seq, tuple(out.run), out.finish))
        if out.finish is not None:
            self._finish_row(seq)
            return results
        self._inputs = out.upcoming
        self._queued = QueuedStep([seq], out.upcoming, {})
        return results

    # ---- speculation for a lone row ------------------------------------------------------------

    def can_speculate(self) -> bool:
        """One row decodes, without logits processors or a grammar, past its first token (in
        flight or read): `speculate` may replace `decode` (`batch_speculate`)."""
        return can_speculate(self.rows, step_queued=self._queued is not None)

    def speculate(self, speculator: Speculator) -> list[RowResult]:
        """One speculative step (`Speculator.step`) for the batch's only row, instead of
        `decode`: first the step already queued is read (without queuing another), then the
        draft proposes and the target verifies on the batch's own cache. The row may emit several
        tokens; its cache then holds `fed_tokens()` and its next input is `pending`, so a plain
        `decode` (another row joined) carries on from there."""
        try:
            results, seq = self._read_for_lone_row()
        except Exception as exc:
            return self._fail_batch(exc)
        if seq is None:
            return results
        try:
            out = speculate_row(seq, speculator, self._cache, self._eos)
        except Exception as exc:
            return results + self._fail_batch(exc)
        if out.pending is not None:
            self._inputs = mx.array([out.pending], dtype=mx.uint32)
        if out.finish is not None:
            self._finish_row(seq)
        results.append(RowResult(seq, out.tokens, out.finish, out.logprobs))
        return results

    # ---- leaving: finished, removed, failed rows (`batch_leave`) ------------------------------

    def _finish_row(self, seq: BatchSequence) -> None:
        """`seq` has finished: it leaves at the next step, its cache taken out for a snapshot (a
        sequence that ended at its first token before joining leaves `waiting`, its own cache
        kept)."""
        seq.finished = seq.removed = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        seq.cache = self._extract(self.rows.index(seq))

    def _extract(self, row: int) -> list[Any]:
        """Row `row`'s cache: the lone row's own (no copy) or a copy out of the batch cache."""
        return row_cache(self.rows, self._cache, row, solo=self.solo)

    def _drop_removed(self) -> None:
        """Removed rows leave the batch before its next step (`batch_leave.left`)."""
        if not any(seq.removed for seq in self.rows):
            return
        self._choice.rows_changed()
        self.rows, self._cache, self._inputs, self.solo = left(
            self.rows, self._cache, self._inputs, solo=self.solo, solo_rows=self._solo_rows
        )

    def _fail_batch(self, exc: Exception) -> list[RowResult]:
        """Fail every live row (`batch_leave.failed`); the batch starts again empty."""
        results = failed(self.rows, exc)
        self.rows, self._cache, self._inputs, self._queued = [], [], None, None
        self.solo = False
        self._choice.rows_changed()
        return results

    # ---- joining: prefill, then join (`batch_join`) ------------------------------------------

    def prefill(self, tokens: int, seconds: float) -> list[PrefillResult]:
        """Prefill waiting sequences until `tokens` prompt tokens or `seconds` are spent: with
        `group_prefill`, first the short prompts of several arrivals together in one pass where
        they can (`batch_prefill`); then in admission order a chunk each (`batch_join.prefill`).
        Ready sequences join only at `join()`. A sequence with media alone in the batch takes
        its first token from its prompt's last pass, once the rest fits its tail: after its
        chunk, if that brought it there (`lone_media`, `batch_lone_media`); that pass's result
        carries the token."""
        self.dispatch_pending()  # the decode step first: its rows wait on it
        lone = None
        if self.lone_media and len(self.waiting) == 1:
            seq = self.waiting[0]
            if alone_with_media(seq, decoding=self.decoding, waiting=1):
                lone = seq
        if lone is not None and fits_first_pass(lone):
            return [self._first_token(lone)]
        results, group_failed = batch_join.prefill(
            self._model,
            self.waiting,
            self._plan,
            tokens,
            seconds,
            group=self._grouping(),
            bucketed=self._padded_prefill,
            rungs=self.decoding > 0,
        )
        self.group_failures += group_failed
        if lone is not None and lone in self.waiting and fits_first_pass(lone):
            results.append(self._first_token(lone))  # its last prompt token, as in its lane
        return results

    def _grouping(self) -> bool:
        """Whether several arrivals' short prompts prefill in one pass (`group_prefill`)."""
        grouping = self._padded_prefill if self.group_prefill is None else self.group_prefill
        return bool(grouping) and not self._split

    def _first_token(self, seq: BatchSequence) -> PrefillResult:
        """The pass of `seq`'s prompt's rest with its first token (`batch_lone_media`), the token
        chosen as a row's and read at once: it becomes the sequence's `pending` input, or the
        sequence ends there and leaves `waiting` (EOS, `max_tokens`, a failed choice)."""
        try:
            logits, n = first_token_pass(seq)
            token, logprobs = self._choice.first(seq, logits)
            results = self._read(QueuedStep([seq], token, logprobs), fed=False)
        except Exception as exc:
            self.waiting.remove(seq)
            return PrefillResult(seq, error=f"{type(exc).__name__}: {exc}")
        (read,) = results
        if read.error is not None:
            self.waiting.remove(seq)
            return PrefillResult(seq, error=read.error)
        return PrefillResult(
            seq, n, tokens=read.tokens, finish=read.finish, logprobs=read.logprobs, first_token=True
        )

    def join(self, *, defer_long: bool = False) -> int:
        """Let every ready waiting sequence join the batch (after its prefill's snapshots were
        taken; `batch_join.joined`); return how many joined (`joined_prompt_tokens`: how many
        of them with their last prompt token as their input).

        `defer_long` (the runner's step has just run a prefill chunk while rows decode): a
        sequence whose prompt took several chunks of its own joins at the next step instead,
        once (`deferred_joins` counts them). Its join costs a step's worth or more (a part of
        its own, `batch_segments`, or every row's cache re-laid to its length; and the first
        step at the batch's new shape: on the H100's 8B, 16 rows joined by an 8,000-token one,
        27-61 ms), and its last chunk took this step's prefill budget already: together the
        running rows' gap would grow by both. A prompt of one chunk or a group pass joins at
        once (its join is as narrow as the batch)."""
        held: set[int] = set()
        if defer_long:
            for seq in self.waiting:
                if seq.ready and seq.chunks_run > 1 and not seq.join_deferred:
                    seq.join_deferred = True
                    held.add(id(seq))
            self.deferred_joins += len(held)
        joiners = [s for s in self.waiting if s.ready and id(s) not in held]
        self.joined_prompt_tokens = sum(1 for s in joiners if s.pending is None)
        if not joiners:
            return 0
        self.waiting = [s for s in self.waiting if not s.ready or id(s) in held]
        self._choice.rows_changed()
        self._cache, self._inputs, self.solo = batch_join.joined(
            joiners,
            self._cache,
            self._inputs,
            empty=not self.rows,
            solo=self.solo,
            solo_rows=self._solo_rows,
            segments=self._segments,
        )
        self.rows.extend(joiners)
        return len(joiners)
