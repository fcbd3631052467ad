"""SpecPrefill on the batched route: a long prompt's sparse prefill while it waits to join the
decode batch. Runs on the runner thread only, for `BatchDecoder.add_specprefill`.

A `SpecPrefillRow` is a `BatchSequence` whose prefill chunks (`prefill_chunk`, one a pass of the
batch loop, under the pacer's budget like any waiting sequence's) are `specprefill.SparsePrefill`'s:
first the scoring chunks (the scoring model over the prompt, then its attention window and the
selection: `scoring` is True until then), then the kept tokens through the target, each at its
true position, into a cache of its own (`PositionedKVCache` layers). Once scored, its `job` is the
kept tokens' (as the serialized route's `SpecPrefillSequence` decodes them): `prompt_done`,
`cached_length` and `ready` count kept tokens, which is what its cache holds, and its sampler
sees the kept tokens as its prompt. When every kept token but the last is in its cache, its
`position_shift` (the prompt tokens skipped) is set on the host and on its cache, so that its
last prompt token, its input at the step after it joins, sits at position `n - 1`.

It then joins like any sequence (`batch_join.joined`). Its positions stay its own after it
joins: a lone row keeps its `PositionedKVCache` (`offset` = stored positions + shift); in a batch
cache (`batch_layout`) its row's `offset` (mlx-lm's per-row RoPE position) is its true position
while its write index and left padding (the mask's) follow what it stores; copied out of a batch
cache (the last row left, or a finished row) it becomes a `PositionedKVCache` again, from its
`position_shift`.

Approximate, like the serialized route's: `snapshot_safe` is False (nothing of it enters the
prefix cache; it starts from no cached prefix), it never speculates with a draft model
(`batch_speculate`), and it never prefills in a group with other arrivals (`batch_prefill`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.sampling import TokenSelector
from trio_mlx.engine.specprefill import SparsePrefill, SpecPrefillCounters, SpecPrefillSettings


class SpecPrefillRow(BatchSequence):
    """A sequence of the decode batch whose prompt is prefilled sparsely (module docstring)."""

    sparse = True
    snapshot_safe = False

    def __init__(
        self,
        job: GenerationJob,
        model: Any,
        scorer: Any,
        settings: SpecPrefillSettings,
        counters: SpecPrefillCounters,
        *,
        vocab_size: int,
        plan: PrefillPlan,
    ) -> None:
        job = dataclasses.replace(job, store_points=())
        super().__init__(
            job,
            model,
            vocab_size=vocab_size,
            plan=PrefillPlan(plan.step),
            max_kv_size=None,
            cache=None,
            cached_tokens=0,
            split_at_store_points=False,
        )
        self._sparse: SparsePrefill | None = SparsePrefill.for_job(
            job, model, scorer, settings, counters
        )
        self.cache = list(self._sparse.cache)
        self._vocab_size = vocab_size
        #: the prompt's length (its `job` holds the kept tokens once they are chosen)
        self.prompt_length = len(job.prompt_tokens)
        #: the prompt positions kept, ascending, once scored (None: scoring)
        self.kept_positions: list[int] | None = None

    @property
    def scoring(self) -> bool:
        return self._sparse is not None and self._sparse.scoring

    def prefill_chunk(
        self, model: Any, limit: int, *, rungs: bool = False
    ) -> tuple[int, tuple[int, ...]]:
        """One scoring chunk or one sparse prefill chunk of at most `limit` tokens (`model` is
        the batch's, which the sparse prefill holds already; `rungs` does not apply); return the
        tokens through the scoring model (while `scoring` before the call) or the kept tokens
        prefilled, and no store points (none are taken). Raises whatever the models raise."""
        sparse = self._sparse
        if sparse is None:
            return 0, ()
        scoring = sparse.scoring
        n = sparse.step(min(limit, self._plan.step))
        if scoring:
            if not sparse.scoring:
                self._keep(sparse)
            return n, ()
        self.prompt_done = sparse.fed
        if sparse.done:
            self.position_shift = sparse.finish()
            self._sparse = None  # its cache is `self.cache` now, until it joins
        return n, ()

    def _keep(self, sparse: SparsePrefill) -> None:
        """The kept set is chosen: from now on this sequence's prompt is the kept tokens."""
        assert sparse.kept is not None
        kept = sparse.kept_tokens()
        self.kept_positions = list(sparse.kept)
        self.job = dataclasses.replace(self.job, prompt_tokens=kept)
        self.key_tokens = kept
        self._prompt = mx.array(kept, dtype=mx.uint32)
        self.selector = TokenSelector(self.job.params, self._vocab_size, kept)
        if self.history is not None:
            self.history = mx.array(kept, dtype=mx.int32)
