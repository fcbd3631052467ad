"""One sequence's generation as a series of bounded steps. Runs on the runner thread only.

A step is either one prefill chunk (at most `prefill_step_size` prompt tokens) or one decode step
(one new token). Between steps the runner is free to look at its inbox, so an abort takes effect
within one chunk or one token.

The arithmetic mirrors `mlx_lm.generate_step` so that greedy output is identical token for token:
all prompt tokens but the last go through the model in chunks, the last one alone produces the
first logits, and each decode step queues the next token's computation (`mx.async_eval`) before
reading the current one, so the device never waits on Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from trio_mlx.engine.sampling import make_sampler
from trio_mlx.types import SamplingParams


@dataclass(frozen=True)
class GenerationJob:
    """What the runner needs to run one request: plain values only, safe to cross threads.

    `max_tokens` in `params` is already capped to what fits in the model's context.
    """

    request_id: int
    prompt_tokens: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class StepResult:
    """What one step of one sequence produced.

    `tokens` are new completion tokens (EOS never included). `finish` is `"stop"` (EOS) or
    `"length"` (max_tokens) when the sequence is done, else None. `prefilled` counts the prompt
    tokens processed by this step.
    """

    tokens: tuple[int, ...] = ()
    finish: str | None = None
    prefilled: int = 0


class ActiveSequence:
    """The live state of one generation: its KV cache, its sampler and where it has got to."""

    def __init__(
        self,
        job: GenerationJob,
        model: Any,
        eos_token_ids: frozenset[int],
        prefill_step_size: int,
    ) -> None:
        if not job.prompt_tokens:
            raise ValueError("a generation needs at least one prompt token")
        self.job = job
        self._model = model
        self._eos = eos_token_ids
        self._prefill_step_size = max(1, prefill_step_size)
        self._cache = make_prompt_cache(model)
        self._sampler = make_sampler(job.params)
        self._prompt = mx.array(job.prompt_tokens, dtype=mx.uint32)
        self._prompt_done = 0
        self._current: Any = None  # the token being computed for the consumer, lazily
        self.generated = 0
        self.finished = False

    @property
    def in_prefill(self) -> bool:
        return self._current is None and not self.finished

    def step(self) -> StepResult:
        """Advance by one prefill chunk or one token. Raises whatever the model raises."""
        if self.finished:
            return StepResult(finish="length")
        remaining = len(self.job.prompt_tokens) - self._prompt_done
        if remaining > 1:
            n = min(self._prefill_step_size, remaining - 1)
            chunk = self._prompt[self._prompt_done : self._prompt_done + n]
            self._model(chunk[None], cache=self._cache)
            mx.eval([c.state for c in self._cache])
            self._prompt_done += n
            mx.clear_cache()
            return StepResult(prefilled=n)
        if self._current is None:
            last = self._prompt[self._prompt_done :]
            self._prompt_done += len(last)
            self._current = self._forward(last)
            mx.async_eval(self._current)
            return self._decode_one(prefilled=len(last))
        return self._decode_one(prefilled=0)

    def _forward(self, tokens: Any) -> Any:
        logits = self._model(tokens[None], cache=self._cache)
        return self._sampler(logits[:, -1, :])

    def _decode_one(self, prefilled: int) -> StepResult:
        last_one = self.generated + 1 >= self.job.params.max_tokens
        upcoming = None
        if not last_one:
            upcoming = self._forward(self._current)
            mx.async_eval(upcoming)
        token = int(self._current.item())
        self._current = upcoming
        if token in self._eos:
            self.finished = True
            return StepResult(finish="stop", prefilled=prefilled)
        self.generated += 1
        if self.generated % 256 == 0:
            mx.clear_cache()
        if last_one:
            self.finished = True
            return StepResult(tokens=(token,), finish="length", prefilled=prefilled)
        return StepResult(tokens=(token,), prefilled=prefilled)
