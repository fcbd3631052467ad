"""One sequence's generation as a series of bounded steps. Runs on the runner thread only.

A step is either one prefill chunk (at most `prefill_step_size` prompt tokens) or one decode step
(one new token). Between steps the runner is free to look at its inbox, so an abort takes effect
within one chunk or one token.

`ActiveSequence` is the serialized route's sequence: it runs a `GenerationJob` with its prompt cut
as a `PrefillPlan` says and reports each step as a `StepResult`. Those types, shared by every
route, are `generation_job`'s; this module re-exports them (`__all__`).

The arithmetic follows `mlx_lm.generate_step`: the prompt goes through the model in chunks of
`prefill_step_size` tokens and the last position's logits give the first token (`PrefillPlan`).
Where mlx-lm always feeds the last prompt token alone, on a GPU a tail of up to `PrefillPlan.tail`
tokens (64; 1,024 on CUDA: most chat prompts whole) goes in that same forward pass (one forward pass
fewer; greedy output can differ from mlx-lm's only where two logits tie within rounding). Without
logits processors each decode step queues the next token's computation (`mx.async_eval`) before
reading the current one, so the device never waits on Python. The first token is the exception: its
step builds the next step's graph while the device computes the first token, but queues it only at
the next step, after the first token has been handed over (queuing a step costs host time: ~1 ms on
the CPU backend). While logits processors are active, steps run one at a time (a processor must see
every token before it shapes the next); once every retiring processor has retired, pipelining
resumes.

Constrained decoding (a job with a `grammar`): the sequence owns a `GrammarMatcher`. Each decode
step still queues the next forward pass before reading the current token (so the device never
waits for the host to build the model's graph); then the token is read, the matcher advanced
with it, the next mask computed on the CPU while the device runs that forward pass, and only the
token choice, masked, waits for it. The choice costs as little dispatch as it can
(`structured/masked_choice`): greedy with nothing but the mask shaping it, a mask that allows a
single token is the choice without device work, otherwise one fused masked argmax. A token that
completes the grammar ends the sequence (`finish="stop"`) at once; a grammar that is complete
but could go on allows the EOS tokens. Such a greedy sequence also jumps forward: the tokens its
grammar forces next (`structured/forced_runs`) are read ahead and fed in one forward pass, so a
step may emit a run of tokens (the same tokens one step each would give). Logprobs are the
model's own, before the mask (as before any bias or penalty).

Prefix caching: a sequence may start from a restored cache that already holds the first
`cached_tokens` prompt tokens (it then prefills only the rest). Each step reports the job's
`store_points` its prefill reached, so that the runner can snapshot the cache there: with
`split_at_store_points` (a cache that cannot be cut afterwards) prefill chunks end exactly at
them; otherwise chunks run past them (no extra forward pass, which costs milliseconds on a GPU)
and the runner snapshots the prefix (`kv_snapshots.snapshot_prefix`). `fed_tokens` tells which
tokens the cache holds at any step boundary (the key of a snapshot taken then).

Shape blocks (`PrefillPlan.block` > 1, for caches that can be trimmed): every prefill forward pass
starts and ends on a multiple of the block. Chunks are whole blocks; the tail is padded up to a
whole block with copies of the last prompt token, its first token read at the last real position,
and the cache trimmed back by the padding afterwards (causal attention: no real position sees the
padding). So the attention kernels only ever see (query length, key length) pairs from a small set,
whatever the prompt's length. MLX's CUDA backend builds a cuDNN graph for each new pair (50-150 ms
each on the H200), which otherwise every prompt of a new length pays; with blocks a server builds
each shape once (the first request of a new shape pays for up to two).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from trio_mlx.engine.compiled_step import CompiledDecode
from trio_mlx.engine.generation_job import (
    CUDA_FUSED_TAIL_TOKENS,
    CUDA_PREFILL_BLOCK,
    GPU_FUSED_TAIL_TOKENS,
    GenerationJob,
    LogitsProcessor,
    PendingToken,
    PrefillPlan,
    StepResult,
    read_logprobs,
)
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.engine.padded_attention import forward_run, padded_attention_default
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.engine.sampling import TokenSelector, logprob_arrays
from trio_mlx.engine.scheduling import with_the_rest
from trio_mlx.structured import masked_choice
from trio_mlx.structured.forced_runs import MAX_RUN, forced_run

# `ActiveSequence` is this module's own; the rest are `generation_job`'s, re-exported for the many
# modules, tests and benchmarks that import them from here.
__all__ = [
    "CUDA_FUSED_TAIL_TOKENS",
    "CUDA_PREFILL_BLOCK",
    "GPU_FUSED_TAIL_TOKENS",
    "ActiveSequence",
    "GenerationJob",
    "LogitsProcessor",
    "PendingToken",
    "PrefillPlan",
    "StepResult",
    "read_logprobs",
]


class ActiveSequence:
    """The live state of one generation: its KV cache, its sampler and where it has got to.

    `jump_forward` (class-wide, on): under a grammar, a greedy sequence feeds the runs of tokens
    its grammar forces in one forward pass each (`structured/forced_runs`); off, one step each.

    `cache`, when given, is a live prompt cache already holding the first `cached_tokens` prompt
    tokens (a restored snapshot, `1 <= cached_tokens < len(prompt)`); it becomes this sequence's
    own. Otherwise a fresh cache is made (`prompt_cache.make_cache`, bounded by `max_kv_size`).
    `prefill` says how the prompt is cut (`PrefillPlan`); with a block, a restored cache must hold
    a multiple of it, and the cache must be trimmable (no `split_at_store_points`).
    `compiled`: the model's traced decode step (`compiled_step`) or its lean one-token step
    (`lean_step`); one-token forward passes use it when the cache fits it (`fits`), prefill never
    does.
    """

    jump_forward = True

    def __init__(
        self,
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
        compiled: CompiledDecode | LeanStep | None = None,
    ) -> None:
        if not job.prompt_tokens:
            raise ValueError("a generation needs at least one prompt token")
        if prefill.block > 1 and (split_at_store_points or cached_tokens % prefill.block):
            raise ValueError(
                f"prefill block {prefill.block} needs a trimmable cache holding a multiple of it, "
                f"not {cached_tokens} tokens"
            )
        if cache is None:
            cached_tokens = 0
        elif not 0 < cached_tokens < len(job.prompt_tokens):
            raise ValueError(
                f"a restored cache must hold 1..{len(job.prompt_tokens) - 1} prompt tokens, "
                f"not {cached_tokens}"
            )
        self.job = job
        self._model = model
        self._eos = eos_token_ids
        self._plan = prefill
        self._cache = make_cache(model, max_kv_size) if cache is None else cache
        self.cached_tokens = cached_tokens
        last = len(job.prompt_tokens) - 1
        self._store_points = sorted({p for p in job.store_points if cached_tokens < p <= last})
        self._split = split_at_store_points
        self._fed_generated: list[int] = []  # generated tokens that went through the model
        self._selector = TokenSelector(job.params, vocab_size, job.prompt_tokens)
        self._processors: list[LogitsProcessor] = list(job.logits_processors)
        self._grammar = job.grammar.matcher() if job.grammar is not None else None
        self._history: Any = (
            mx.array(job.prompt_tokens, dtype=mx.int32) if self._processors else None
        )
        self._prompt = mx.array(job.prompt_tokens, dtype=mx.uint32)
        self._prompt_done = cached_tokens
        self._current: PendingToken | None = None  # the token being computed for the consumer
        # `_current` is built but not yet queued on the device (the first token's successor:
        # see `_decode_one`); the next step queues it.
        self._current_unqueued = False
        self._compiled = compiled  # None once the cache turns out not to fit it
        self._fits_checked = False
        self._pad_runs = padded_attention_default()  # forced runs' passes padded to one shape
        self._params = job.params
        self.generated = 0
        self.finished = False

    @property
    def in_prefill(self) -> bool:
        return self._current is None and not self.finished

    @property
    def cache(self) -> list[Any]:
        """The live prompt cache (snapshot it only at a step boundary)."""
        return self._cache

    @property
    def prefill_done(self) -> bool:
        """Every prompt token has gone through the model."""
        return self._prompt_done >= len(self.job.prompt_tokens)

    def fed_tokens(self) -> tuple[int, ...]:
        """The tokens the cache holds at this step boundary, in order: the prompt tokens
        processed so far, then the generated tokens fed back (a token is fed when the next one
        is computed, so an EOS is fed on the pipelined path, and the last token of a
        `max_tokens` finish never is)."""
        return self.job.prompt_tokens[: self._prompt_done] + tuple(self._fed_generated)

    def step(self, prefill_limit: int | None = None) -> StepResult:
        """Advance by one prefill chunk (at most `prefill_limit` tokens, whole blocks, when given)
        or one token. Raises whatever the model raises."""
        if self.finished:
            return StepResult(finish="length")
        remaining = len(self.job.prompt_tokens) - self._prompt_done
        plan = self._plan
        fuse_tail = remaining <= plan.tail and not (self._split and self._store_points)
        if remaining > 1 and not fuse_tail:
            n = min(plan.step, remaining - 1)
            if prefill_limit is not None:
                n = min(n, max(with_the_rest(prefill_limit, remaining - 1), plan.block))
            n -= n % plan.block  # >= one block: remaining > the tail >= a block
            points = self._store_points
            if points and self._split:
                n = min(n, points[0] - self._prompt_done)
            chunk = self._prompt[self._prompt_done : self._prompt_done + n]
            self._model(chunk[None], cache=self._cache)
            mx.eval([c.state for c in self._cache])
            self._prompt_done += n
            mx.clear_cache()
            reached = []
            while points and points[0] <= self._prompt_done:
                reached.append(points.pop(0))
            return StepResult(prefilled=n, store_points=tuple(reached))
        if self._current is None:
            last = self._prompt[self._prompt_done :]
            real = len(last)
            self._prompt_done += real
            padding = -real % plan.block
            if padding:
                last = mx.concatenate([last, mx.repeat(last[-1:], padding)])
            self._current = self._forward(last, position=real - 1)
            if padding:
                for layer in self._cache:
                    layer.trim(padding)
            mx.async_eval(*self._current.arrays())
            result = self._decode_one(prefilled=real)
            if not self._store_points:
                return result
            tail_points = tuple(self._store_points)  # all within the prompt, now all reached
            self._store_points.clear()
            return dataclasses.replace(result, store_points=tail_points)
        if self._current_unqueued:
            assert self._current is not None
            mx.async_eval(*self._current.arrays())
            self._current_unqueued = False
        return self._decode_one(prefilled=0)

    def _forward(self, tokens: Any, position: int = -1) -> PendingToken:
        compiled = self._compiled_for(tokens)
        if (
            compiled is not None
            and self._grammar is None
            and not (self._processors or self._selector.adjusts_logits or self._params.logprobs)
            and self._selector.batch_greedy
        ):  # plain greedy: the argmax is part of the trace
            return PendingToken(compiled.step(tokens, self._cache, greedy=True))
        raw = self._logits(tokens, position, compiled)
        if self._grammar is not None:
            mx.async_eval(raw)  # the device runs the pass while the host computes the mask
        return self._select(raw)

    def _compiled_for(self, tokens: Any) -> CompiledDecode | LeanStep | None:
        """The traced or lean step, when it can take this pass (one token, a cache it fits, not
        empty)."""
        compiled = self._compiled if tokens.shape[0] == 1 else None
        if compiled is not None and not self._fits_checked:
            self._fits_checked = True  # a cache's layer classes never change
            if not compiled.fits(self._cache):
                compiled = self._compiled = None
        if compiled is not None and self._cache[0].keys is None:
            compiled = None  # nothing cached yet (a one-token prompt): a plain pass first
        return compiled

    def _logits(
        self, tokens: Any, position: int = -1, compiled: CompiledDecode | LeanStep | None = None
    ) -> Any:
        if compiled is None:
            return self._model(tokens[None], cache=self._cache)[:, position, :]
        return compiled.step(tokens, self._cache, greedy=False)

    def _select(self, raw: Any) -> PendingToken:
        """The token chosen from `raw` logits: processors, bias and penalties, the grammar's
        mask, then the sampler. Greedy under a grammar with nothing else shaping the choice:
        the token the mask forces when it allows one (no device work), else the fused masked
        argmax (`masked_choice`)."""
        if self._grammar is not None and self._greedy_alone:
            token, _ = masked_choice.greedy_choice(raw, self._grammar.allowed_words()[None])
            return self._pending(raw, token)
        logits = raw
        if self._processors:
            for processor in self._processors:
                logits = processor(self._history, logits)
        if self._selector.adjusts_logits:
            logits = self._selector.adjust(logits)
        if self._grammar is not None:
            logits = masked_choice.masked_logits(logits, self._grammar.allowed_words()[None])
        token = self._selector.choose(logits)
        if self._processors:
            self._history = mx.concatenate([self._history, token.astype(mx.int32)])
        return self._pending(raw, token)

    @property
    def _greedy_alone(self) -> bool:
        """Greedy with no processor, bias or penalty: only a grammar's mask shapes the choice."""
        return not self._processors and self._selector.greedy and not self._selector.adjusts_logits

    def _pending(self, raw: Any, token: Any) -> PendingToken:
        """`token` (chosen from `raw` logits) with its logprob arrays when they are asked for."""
        params = self._params
        if not params.logprobs:
            return PendingToken(token)
        chosen, ids, values = logprob_arrays(raw, token, params.top_logprobs)
        return PendingToken(token, chosen, ids, values)

    def _decode_one(self, prefilled: int) -> StepResult:
        if self._grammar is not None:
            return self._decode_constrained(prefilled)
        assert self._current is not None
        current = self._current
        last_one = self.generated + 1 >= self.job.params.max_tokens
        # The first token's successor is queued on the device only at the next step, after the
        # first token has been handed over (queuing a step costs milliseconds of host time);
        # where possible its graph is built now, while the device computes the first token.
        first = prefilled > 0
        pipelined = not self._processors
        upcoming = None
        if pipelined and not last_one:
            upcoming = self._forward(current.token)
            if not first:
                mx.async_eval(*upcoming.arrays())
        token = int(current.token.item())
        logprobs = (read_logprobs(token, current),) if current.chosen is not None else ()
        if not pipelined:
            self._processors = [p for p in self._processors if not getattr(p, "is_retired", False)]
            if not last_one and token not in self._eos:
                upcoming = self._forward(current.token)
                if not first:
                    mx.async_eval(*upcoming.arrays())
        self._current = upcoming
        self._current_unqueued = first and upcoming is not None
        if upcoming is not None:
            self._fed_generated.append(token)
        if token in self._eos:
            self.finished = True
            return StepResult(finish="stop", prefilled=prefilled)
        self.generated += 1
        if self.generated % 256 == 0:
            mx.clear_cache()
        if last_one:
            self.finished = True
            return StepResult((token,), "length", prefilled, logprobs)
        return StepResult((token,), None, prefilled, logprobs)

    def _decode_constrained(self, prefilled: int) -> StepResult:
        """`_decode_one` under a grammar (see the module docstring): the next forward pass is
        queued before the token is read; its mask, after."""
        current, grammar = self._current, self._grammar
        assert current is not None and grammar is not None
        last_one = self.generated + 1 >= self.job.params.max_tokens
        first = prefilled > 0
        raw = None
        if not last_one:
            raw = self._logits(current.token, -1, self._compiled_for(current.token))
            if not first:
                mx.async_eval(raw)
        token = int(current.token.item())
        logprobs = (read_logprobs(token, current),) if current.chosen is not None else ()
        if self._processors:
            self._processors = [p for p in self._processors if not getattr(p, "is_retired", False)]
        eos = token in self._eos
        if not eos:
            grammar.consume(token)
        upcoming = None
        run: list[int] = []
        if raw is not None:
            self._fed_generated.append(token)  # its forward pass is built: the cache holds it
            if not eos and not grammar.done:
                room = self.job.params.max_tokens - self.generated - 1
                run = self._forced_run(int(raw.shape[-1]), room)
                ends = grammar.done or len(run) == room
                if run and not ends:
                    raw = self._feed_run(run)  # the next token's logits: after the run
                    self._fed_generated.extend(run)
                if not ends:
                    upcoming = self._select(raw)
                    if not first:
                        mx.async_eval(*upcoming.arrays())
        self._current = upcoming
        self._current_unqueued = first and upcoming is not None
        if eos:
            self.finished = True
            return StepResult(finish="stop", prefilled=prefilled)
        before = self.generated
        self.generated += 1 + len(run)
        if self.generated // 256 != before // 256:
            mx.clear_cache()
        tokens = (token, *run)
        if grammar.done or self.generated >= self.job.params.max_tokens:
            self.finished = True
            return StepResult(tokens, "stop" if grammar.done else "length", prefilled, logprobs)
        return StepResult(tokens, None, prefilled, logprobs)

    def _forced_run(self, width: int, room: int) -> list[int]:
        """The tokens the grammar forces next (`structured/forced_runs`), at most `room`, for a
        sequence that may jump forward: greedy with nothing but its mask shaping the choice, no
        logprobs, plain trimmable caches, not the traced step (the lean one keeps the cache
        plain). Consumed by the matcher."""
        assert self._grammar is not None
        eligible = (
            self.jump_forward
            and self._greedy_alone
            and not self._params.logprobs
            and not isinstance(self._compiled, CompiledDecode)
            and all(type(layer) is KVCache for layer in self._cache)
        )
        if not eligible:
            return []
        return forced_run(self._grammar, width, min(MAX_RUN, room))

    def _feed_run(self, run: list[int]) -> Any:
        """Feed `run` to the model in one forward pass; return the logits after its last token
        (shape (1, vocab)). Where attention shapes must recur (MLX's CUDA backend) the pass is
        padded to `MAX_RUN` tokens with attention over the cache's whole buffer
        (`padded_attention`) and the padding trimmed off the cache."""
        return forward_run(self._model, run, self._cache, MAX_RUN if self._pad_runs else None)
