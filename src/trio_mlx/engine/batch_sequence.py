"""`BatchSequence`: one sequence of a `BatchDecoder` (`batch.py`), from its admission to its
end. Runs on the runner thread only.

It owns what is the sequence's own whatever its companions: its job, its `TokenSelector` (its
own seeded draws), its logits processors and their token history, its grammar's matcher, its draft
state once it has speculated, and where it has got to (`prompt_done`, the generated tokens fed
and read, `pending`). While it waits to join the batch it prefills on a cache of its own,
`prefill_chunk` by chunk (whole blocks of its `PrefillPlan`, cut at its store points when the
model's cache cannot be cut back afterwards). The decoder owns the batch's cache and moves the
sequence's in and out of it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from trio_mlx.engine.decode import GenerationJob, LogitsProcessor, PrefillPlan
from trio_mlx.engine.padded_attention import padded_layers
from trio_mlx.engine.prefill_shapes import PADDED_UP_TO, key_width, pass_size, reserve
from trio_mlx.engine.prompt_cache import make_cache, without_kept_tokens
from trio_mlx.engine.sampling import TokenSelector
from trio_mlx.engine.scheduling import with_the_rest


class BatchSequence:
    """One sequence of a `BatchDecoder`: its job, sampler, processors and where it has got to.

    `cache` is its own prompt cache while it prefills, None while it is a row of the batch, and
    the cache extracted from the batch once it has left (finished or aborted), for a snapshot.
    """

    #: its prompt is prefilled sparsely (SpecPrefill, `batch_specprefill.SpecPrefillRow`): its
    #: cache is approximate and its positions run past its cached length (`position_shift`)
    sparse = False
    #: what its cache holds is exactly its fed tokens' (the snapshot keeper reads it)
    snapshot_safe = True

    def __init__(
        self,
        job: GenerationJob,
        model: Any,
        *,
        vocab_size: int,
        plan: PrefillPlan,
        max_kv_size: int | None,
        cache: list[Any] | None,
        cached_tokens: int,
        split_at_store_points: bool,
        padded: bool = False,
        key_tokens: tuple[int, ...] | None = None,
    ) -> None:
        if not job.prompt_tokens:
            raise ValueError("a generation needs at least one prompt token")
        if cache is None:
            cached_tokens = 0
        self.job = job
        self.request_id = job.request_id
        #: the prompt as the prefix cache keys it (a prompt with media: its media positions in
        #: ids of the media's hash, `multimodal.prepare`); the prompt's own tokens otherwise
        self.key_tokens = key_tokens if key_tokens is not None else job.prompt_tokens
        #: a prompt with media (its own key tokens): what a text draft model never saw
        self.media = key_tokens is not None
        #: the shift of this row's positions past its prompt (a prompt with media on an MRoPE
        #: model: its rope delta, set once its media are encoded; `multimodal.joining`)
        self.rope_delta = 0
        #: what its prompt's chunks go through instead of the batch's model (a prompt with
        #: media: its merged embeddings, `multimodal.job.PromptEmbeddingModel`; also its steps
        #: while it decodes alone, `batch_lone_media`); None: the model
        self.prefill_model: Any = None
        # a bounded window keeps no leading positions in a batch (`prompt_cache`'s docstring)
        self.cache: list[Any] | None = (
            make_cache(model, max_kv_size, keep=0) if cache is None else without_kept_tokens(cache)
        )
        self.cached_tokens = cached_tokens
        self._plan = plan if cached_tokens % plan.block == 0 else PrefillPlan(plan.step)
        self._split = split_at_store_points
        self._padded = padded  # chunks of recurring attention shapes (`prefill_shapes`)
        last = len(job.prompt_tokens) - 1
        self._store_points = sorted({p for p in job.store_points if cached_tokens < p <= last})
        self._prompt = mx.array(job.prompt_tokens, dtype=mx.uint32)
        self.prompt_done = cached_tokens
        self.selector = TokenSelector(job.params, vocab_size, job.prompt_tokens)
        self.processors: list[LogitsProcessor] = list(job.logits_processors)
        self.grammar = job.grammar.matcher() if job.grammar is not None else None
        self.history: Any = mx.array(job.prompt_tokens, dtype=mx.int32) if self.processors else None
        self.fed_generated: list[int] = []
        #: the row's next input when it is not yet fed (after a speculative step, or a step read
        #: without a next one queued: `BatchDecoder.speculate`); the next queued step feeds it
        self.pending: int | None = None
        #: the draft model's cache, once this sequence has speculated (`speculative.py`)
        self.draft: Any = None
        #: its last token was the only one its grammar allowed (`batch_constrained`): a run of
        #: forced tokens may follow (`batch_jump`)
        self.forced_last = False
        self.generated = 0
        self.finished = False
        #: how far past its cached length its next position is: the prompt tokens a sparse
        #: prefill skipped (`batch_specprefill`), known on the host; 0 for any other sequence
        self.position_shift = 0
        #: leaves the batch at the next step (finished, aborted or failed)
        self.removed = False
        #: prefill chunks of its own run so far (`batch_join._chunk`; not group passes)
        self.chunks_run = 0
        #: ready, it let a step go by before joining (`BatchDecoder.join`'s `defer_long`)
        self.join_deferred = False
        #: a per-row failure (a processor or the sampler raised), reported at the next read
        self.failure: str | None = None

    @property
    def scoring(self) -> bool:
        """Its prompt is still being scored (a SpecPrefill row): its chunks go through the
        scoring model, not the batch's."""
        return False

    @property
    def ready(self) -> bool:
        """Every prompt token but the last is in the cache: it can join the batch."""
        return self.prompt_done >= len(self.job.prompt_tokens) - 1

    @property
    def prefill_done(self) -> bool:
        return self.prompt_done >= len(self.job.prompt_tokens)

    @property
    def plain(self) -> bool:
        """Greedy, no processors, no penalties, no grammar: chosen by the batch's argmax (bias
        allowed)."""
        return not self.processors and self.grammar is None and self.selector.batch_greedy

    @property
    def tail(self) -> int:
        """The most prompt tokens its first token's pass may take with the last one (its plan's
        fused tail: `batch_lone_media`)."""
        return self._plan.tail

    @property
    def prompt_array(self) -> Any:
        """Its prompt's tokens as an array (uint32)."""
        return self._prompt

    @property
    def cached_length(self) -> int:
        """How many positions this sequence's cache holds: its fed tokens, known on the host (no
        device read), the input of a step in flight included."""
        return self.prompt_done + len(self.fed_generated)

    def fed_tokens(self) -> tuple[int, ...]:
        """The tokens this sequence's cache holds at a call boundary, in order (the prompt's in
        `key_tokens`)."""
        return self.key_tokens[: self.prompt_done] + tuple(self.fed_generated)

    def remaining_prompt(self) -> int:
        """Prompt tokens still to prefill before it can join (all but the last)."""
        return len(self.job.prompt_tokens) - 1 - self.prompt_done

    def advance(self, n: int) -> tuple[int, ...]:
        """`n` more prompt tokens are in the cache; return the store points now reached."""
        self.prompt_done += n
        reached = []
        while self._store_points and self._store_points[0] <= self.prompt_done:
            reached.append(self._store_points.pop(0))
        return tuple(reached)

    def prefill_chunk(
        self, model: Any, limit: int, *, rungs: bool = False
    ) -> tuple[int, tuple[int, ...]]:
        """Run one chunk of at most `limit` prompt tokens (whole blocks, the last padded and cut
        back) on this sequence's own cache; return the tokens prefilled and the store points
        reached. With `padded`, a chunk that leaves some of the prompt is a rung of
        `prefill_shapes.chunk_ladder` (with `rungs`, while other rows decode, every chunk of
        more than a block is: a rest of another size would be an attention shape new to cuDNN,
        65-135 ms on an H100's 8B, where a rung's chunk took 15-22 ms) and, from the second
        chunk on, every chunk's attention runs over its cache's buffer grown to a width bucket
        (`prefill_shapes.key_width`). Raises whatever the model raises."""
        n, padding = self.next_chunk(limit, rungs=rungs)
        if n == 0:
            return 0, ()
        tokens, layers = self.chunk_input(model, n, padding)
        model(tokens[None], cache=layers)
        return n, self.chunk_done(n, padding)

    def next_chunk(self, limit: int, *, rungs: bool = False) -> tuple[int, int]:
        """The prompt tokens of this sequence's next chunk of at most `limit` and the padding that
        makes it whole blocks (`prefill_chunk`); (0, 0) once its prompt is in."""
        assert self.cache is not None
        remaining = self.remaining_prompt()
        if remaining <= 0:
            return 0, 0
        block = self._plan.block
        n = min(with_the_rest(limit, remaining), self._plan.step, remaining)
        if self._split and self._store_points:
            n = min(n, self._store_points[0] - self.prompt_done)
        padded = self._padded and block > 1
        if padded and (n < remaining or rungs):  # cut by the budget, or rows decode: a rung
            n = pass_size(n, block, self._plan.step)
        elif block > 1 and n >= block:
            n -= n % block
        return n, -n % block

    def chunk_input(self, model: Any, n: int, padding: int) -> tuple[Any, list[Any]]:
        """The next chunk's tokens (`n` of the prompt, then `padding` copies of the last) and
        what the pass takes as its cache: the sequence's own, or views of it over its width
        bucket (`prefill_shapes`)."""
        assert self.cache is not None
        chunk = self._prompt[self.prompt_done : self.prompt_done + n]
        if padding:
            chunk = mx.concatenate([chunk, mx.repeat(chunk[-1:], padding)])
        keys = self.prompt_done + n + padding  # what the cache holds after this chunk
        padded = self._padded and self._plan.block > 1
        if padded and keys <= PADDED_UP_TO and reserve(self.cache, key_width(keys)):
            return chunk, padded_layers(model, self.cache, n + padding)
        return chunk, self.cache

    def chunk_done(self, n: int, padding: int, *, evaluate: bool = True) -> tuple[int, ...]:
        """The pass of a chunk of `n` tokens and `padding` has been built: trim the padding off
        the cache, evaluate it (unless `evaluate` is False: the pass is queued with a decode
        step, `mixed_step`), count it; return the store points now reached."""
        assert self.cache is not None
        if padding:
            for layer in self.cache:
                layer.trim(padding)
        if evaluate:
            mx.eval([c.state for c in self.cache])
        return self.advance(n)
