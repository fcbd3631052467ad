"""One sequence of the serialized route decoding with a draft model. Runner thread only.

`SpeculativeSequence` has `decode.ActiveSequence`'s interface (what the runner and the snapshot
keeper use). Its prompt goes through an `ActiveSequence` whose job stops at the first token, so
prefill (chunks, blocks, store points, a restored prefix) and the first token are exactly the
plain route's; every later step is one `Speculator.step`. The cache and `fed_tokens()` say what
the target's cache holds at every step boundary, so snapshots of a speculating sequence are the
same as a plain one's (the draft's cache is not snapshotted: a restored prompt is fed to the draft
again, in bounded chunks, by `Speculator.step`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from trio_mlx.engine.decode import ActiveSequence, GenerationJob, PrefillPlan, StepResult
from trio_mlx.engine.sampling import TokenSelector
from trio_mlx.engine.speculative import Speculator

#: A seeded request's speculative steps draw from seed + this (its first token, drawn by the
#: plain route, from the seed itself), so that no key is used twice.
_SEED_OFFSET = 0x9E3779B97F4A7C15


class SpeculativeSequence:
    """A generation whose tokens after the first come from `speculator` (see the module)."""

    def __init__(
        self,
        speculator: Speculator,
        job: GenerationJob,
        model: Any,
        eos_token_ids: frozenset[int],
        prefill: PrefillPlan,
        *,
        vocab_size: int,
        max_kv_size: int | None = None,
        cache: list[Any] | None = None,
        cached_tokens: int = 0,
        split_at_store_points: bool = True,
    ) -> None:
        first_only = dataclasses.replace(job.params, max_tokens=1)
        self._first = ActiveSequence(
            dataclasses.replace(job, params=first_only),
            model,
            eos_token_ids,
            prefill,
            vocab_size=vocab_size,
            max_kv_size=max_kv_size,
            cache=cache,
            cached_tokens=cached_tokens,
            split_at_store_points=split_at_store_points,
        )
        self.job = job
        self._speculator = speculator
        self._eos = eos_token_ids
        params = job.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + _SEED_OFFSET)
        self._selector = TokenSelector(params, vocab_size, job.prompt_tokens)
        self._draft = speculator.open_draft()
        self._history: list[int] = []  # the target's cache, once the first token is out
        self._pending: int | None = None
        self.generated = 0
        self.finished = False

    @property
    def in_prefill(self) -> bool:
        return self._first.in_prefill

    @property
    def cache(self) -> list[Any]:
        return self._first.cache

    @property
    def cached_tokens(self) -> int:
        return self._first.cached_tokens

    @property
    def prefill_done(self) -> bool:
        return self._first.prefill_done

    def fed_tokens(self) -> tuple[int, ...]:
        if not self._history:
            return self._first.fed_tokens()
        return tuple(self._history)

    def step(self, prefill_limit: int | None = None) -> StepResult:
        """A prefill chunk, the first token, or one speculative step (one or more tokens)."""
        if self.finished:
            return StepResult(finish="length")
        if self._pending is None:
            first = self._first
            result = self._speculator.drafter.during_prefill(
                self._draft, lambda: first.step(prefill_limit), first.fed_tokens
            )
            if not result.tokens:  # a prefill chunk, or EOS first
                self.finished = result.finish is not None
                return result
            token = result.tokens[0]
            self.generated = 1
            self._selector.observe(mx.array([token], dtype=mx.uint32))
            if self.job.params.max_tokens == 1:
                self.finished = True
                return result
            self._history = list(self._first.fed_tokens())
            self._pending = token
            return dataclasses.replace(result, finish=None)
        out = self._speculator.step(
            self.cache,
            self._draft,
            self._history,
            self._pending,
            self._selector,
            self.job.params,
            self._eos,
            self.generated,
        )
        self._history.extend(out.fed)
        self._pending = out.pending
        self.generated += len(out.tokens)
        self.finished = out.finish is not None
        return StepResult(out.tokens, out.finish, 0, out.logprobs)
