"""SpecPrefill: an attention-scored sparse prefill for long prompts. Runner thread only.

Approximate (the target never sees the dropped tokens), in exchange for a shorter time to first
token on long prompts. How it goes, for a prompt of `n >= threshold` tokens (phases 1-3:
`SparsePrefill`, on both routes):

1. Scoring, in chunks (one per step, so that an abort lands between chunks like a prefill's):
   the scoring model (a small model with the target's tokenizer) prefills `prompt[:n - W]`, then
   runs the last `W = SCORING_QUERIES` tokens with an attention recorder on: every layer's
   softmax(q k^T) of those queries over all positions is summed into one score per position.
2. Selection (`select_positions`): the first `backbone_pct * n` tokens (a system prompt) and the
   last `W` are always kept; the rest of the budget (`keep_pct * n` tokens in all) goes to the
   `SELECTION_CHUNK`-token chunks with the highest mean score.
3. Sparse prefill: the target prefills the kept tokens at their TRUE positions, in chunks of
   the prefill size whatever gaps they span: every attention layer's `rope` is wrapped
   (`true_positions.PositionedRoPE`) to rotate each token by its own position while a chunk runs;
   the storage holds only kept tokens, in order, so the causal mask over them is the plain one. A
   model without a `rope` attribute on its attention falls back to one forward pass per run of
   consecutive positions (`PositionedKVCache.shift`). The last kept token (the prompt's last) starts
   decoding at position `n - 1`: every later position continues from the full prompt length
   (`SparsePrefill.finish`).
4. Decoding. On the serialized route (`SpecPrefillSequence`, with `decode.ActiveSequence`'s
   interface) it is the plain route's (`ActiveSequence` over the kept tokens, no draft model, no
   traced step). On the batched route (`batch_specprefill.SpecPrefillRow`) the sequence waits to
   join the batch while phases 1-3 run, a chunk a loop pass, then joins it and decodes among its
   rows at its true positions.

Such a cache is approximate: it is never snapshotted into the prefix cache (`snapshot_safe`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from trio_mlx.engine.decode import ActiveSequence, GenerationJob, PrefillPlan, StepResult
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.engine.true_positions import (
    PositionedKVCache,
    chunk_positions,
    install_positioned_rope,
)

#: Queries at the end of the prompt whose attention scores the rest (always kept).
SCORING_QUERIES = 32
#: Tokens per selection chunk (kept or dropped whole, but for the last one picked).
SELECTION_CHUNK = 32
DEFAULT_THRESHOLD = 8192
DEFAULT_KEEP_PCT = 0.3
DEFAULT_BACKBONE_PCT = 0.05


@dataclass(frozen=True)
class SpecPrefillSettings:
    """The engine's SpecPrefill configuration (`EngineConfig.specprefill*`)."""

    enabled: bool = False
    threshold: int = DEFAULT_THRESHOLD
    keep_pct: float = DEFAULT_KEEP_PCT
    backbone_pct: float = DEFAULT_BACKBONE_PCT

    def applies(self, prompt_length: int, requested: bool | None) -> bool:
        """Whether a prompt of `prompt_length` tokens is sparsely prefilled: the request's
        `specprefill` (None: the engine's `enabled`) and at least `threshold` tokens."""
        on = self.enabled if requested is None else requested
        return on and prompt_length >= max(self.threshold, 2 * SCORING_QUERIES)

    def keep_for(self, job: GenerationJob) -> float:
        """The fraction of `job`'s prompt kept: the request's `specprefill_keep_pct`, else the
        engine's `keep_pct`."""
        keep = job.params.specprefill_keep_pct
        return self.keep_pct if keep is None else keep


@dataclass
class SpecPrefillCounters:
    """Written by the runner thread only."""

    requests: int = 0
    scoring_chunks: int = 0
    prompt_tokens: int = 0
    kept_tokens: int = 0
    scoring_seconds: float = 0.0
    sparse_prefill_seconds: float = 0.0

    def statistics(self) -> dict[str, Any]:
        skipped = self.prompt_tokens - self.kept_tokens
        return {
            "requests": self.requests,
            "scoring_chunks": self.scoring_chunks,
            "prompt_tokens": self.prompt_tokens,
            "kept_tokens": self.kept_tokens,
            "skipped_tokens": skipped,
            "kept_fraction": self.kept_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "scoring_s": self.scoring_seconds,
            "sparse_prefill_s": self.sparse_prefill_seconds,
        }


def select_positions(
    scores: Any, keep_pct: float, backbone_pct: float, tail: int = SCORING_QUERIES
) -> list[int]:
    """The kept prompt positions, ascending: `ceil(keep_pct * n)` of them (at least the forced
    ones): the first `ceil(backbone_pct * n)`, the last `tail`, then the best chunks by mean
    score (a list or 1-d array of `n` scores)."""
    values = [float(s) for s in (scores.tolist() if hasattr(scores, "tolist") else scores)]
    n = len(values)
    budget = min(n, math.ceil(keep_pct * n))
    kept = set(range(min(n, math.ceil(backbone_pct * n))))
    kept.update(range(max(0, n - tail), n))
    chunks = []
    for start in range(0, n, SELECTION_CHUNK):
        free = [p for p in range(start, min(n, start + SELECTION_CHUNK)) if p not in kept]
        if free:
            chunks.append((sum(values[p] for p in free) / len(free), start, free))
    chunks.sort(key=lambda c: (-c[0], c[1]))
    for _, _, free in chunks:
        room = budget - len(kept)
        if room <= 0:
            break
        kept.update(free[:room])
    return sorted(kept)


# ---- attention recording -----------------------------------------------------------------------

_recording = threading.local()
_patched: set[str] = set()
_patch_lock = threading.Lock()


def _install_recorder(model: Any) -> None:
    """Wrap `scaled_dot_product_attention` in the scoring model's module with a recorder that
    is active only on the thread and during `_record` (other calls go through unchanged)."""
    name = type(model).__module__
    module = sys.modules[name]
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        raise ValueError(f"SpecPrefill cannot score with a {name} model (no attention hook)")
    with _patch_lock:
        if name in _patched:
            return

        def recording(queries: Any, keys: Any, values: Any, *args: Any, **kwargs: Any) -> Any:
            sink = getattr(_recording, "scores", None)
            if sink is not None and not isinstance(keys, tuple):
                sink.append(_attention_mass(queries, keys, kwargs.get("scale", 1.0)))
            return original(queries, keys, values, *args, **kwargs)

        setattr(module, "scaled_dot_product_attention", recording)  # noqa: B010
        _patched.add(name)


def _attention_mass(queries: Any, keys: Any, scale: float) -> Any:
    """Softmax attention of the window's queries (the last `L` positions) over all `S` keys,
    causal, summed over heads and queries: shape (S,), float32."""
    b, n_heads, length, dim = queries.shape
    n_kv, s = keys.shape[1], keys.shape[2]
    q = queries.astype(mx.float32).reshape(b, n_kv, n_heads // n_kv, length, dim)
    k = keys.astype(mx.float32)[:, :, None]
    logits = (q * scale) @ k.swapaxes(-1, -2)  # (b, kv, g, L, S)
    query_pos = mx.arange(s - length, s)[:, None]
    logits = mx.where(mx.arange(s)[None] <= query_pos, logits, -mx.inf)
    return mx.softmax(logits, axis=-1).sum(axis=(0, 1, 2, 3))


# ---- scoring and the sparse prefill (both routes) ----------------------------------------------


def _runs(kept: list[int]) -> list[tuple[int, int]]:
    """The runs of consecutive positions of `kept` (ascending), as (start, end), but for the
    last position (the prompt's last token: whoever decodes feeds it, and gets the first token)."""
    runs: list[tuple[int, int]] = []
    start = prev = kept[0]
    for p in kept[1:]:
        if p != prev + 1:
            runs.append((start, prev + 1))
            start = p
        prev = p
    runs.append((start, prev + 1))
    last_start, last_end = runs[-1]
    runs[-1] = (last_start, last_end - 1)
    return [r for r in runs if r[1] > r[0]]


class SparsePrefill:
    """Phases 1-3 of the module docstring for one prompt, a chunk a call (`step`), on a cache of
    its own (`cache`: `PositionedKVCache` layers). What decodes afterwards feeds the prompt's last
    token at position `n - 1` (`finish`): the serialized route's `SpecPrefillSequence`, or the
    batched route's `batch_specprefill.SpecPrefillRow` once it joins the batch."""

    @classmethod
    def for_job(
        cls,
        job: GenerationJob,
        model: Any,
        scorer: Any,
        settings: SpecPrefillSettings,
        counters: SpecPrefillCounters,
    ) -> SparsePrefill:
        """The sparse prefill of `job`'s prompt with the engine's settings and the request's
        keep fraction (`SpecPrefillSettings.keep_for`)."""
        return cls(
            job.prompt_tokens,
            model,
            scorer,
            settings.keep_for(job),
            settings.backbone_pct,
            counters,
        )

    def __init__(
        self,
        prompt_tokens: tuple[int, ...],
        model: Any,
        scorer: Any,
        keep_pct: float,
        backbone_pct: float,
        counters: SpecPrefillCounters,
    ) -> None:
        layers = make_cache(model, None)
        if not all(type(c) is KVCache for c in layers):
            raise ValueError("SpecPrefill needs a model whose every layer has a plain KV cache")
        _install_recorder(scorer)
        self._tokens = prompt_tokens
        self._model = model
        self._scorer = scorer
        self._scorer_cache: list[Any] | None = make_cache(scorer, None)
        self._keep_pct = keep_pct
        self._backbone_pct = backbone_pct
        self._counters = counters
        self._prompt = mx.array(prompt_tokens, dtype=mx.uint32)
        self._scored = 0  # prompt tokens through the scorer
        #: the kept prompt positions, ascending, once scoring is done (None: scoring)
        self.kept: list[int] | None = None
        self._runs: list[tuple[int, int]] = []  # (start, end) positions still to prefill
        #: the target's cache: the kept tokens, in order, each at its own position
        self.cache: list[PositionedKVCache] = [PositionedKVCache() for _ in layers]
        #: kept tokens in `cache`
        self.fed = 0
        #: each kept token rotated by its own position (`PositionedRoPE`), else run by run
        self.positioned = install_positioned_rope(model)

    @property
    def scoring(self) -> bool:
        return self.kept is None

    @property
    def done(self) -> bool:
        """Every kept token but the last (the prompt's last) is in `cache`."""
        return self.kept is not None and self.fed >= len(self.kept) - 1

    def kept_tokens(self) -> tuple[int, ...]:
        assert self.kept is not None
        return tuple(self._tokens[p] for p in self.kept)

    def step(self, limit: int) -> int:
        """One scoring chunk of at most `limit` prompt tokens (the last: the scoring window and
        the selection), or one sparse prefill chunk of at most `limit` kept tokens; return the
        tokens through the scorer or the target. Raises whatever the models raise."""
        limit = max(1, limit)
        began = time.perf_counter()
        if self.kept is None:
            n = self._score_chunk(limit)
            self._counters.scoring_chunks += 1
            self._counters.scoring_seconds += time.perf_counter() - began
            return n
        if self.done:
            return 0
        n = self._prefill_positioned(limit) if self.positioned else self._prefill_run(limit)
        self._counters.sparse_prefill_seconds += time.perf_counter() - began
        return n

    def finish(self) -> int:
        """Once `done`: shift every layer so that the next token (the prompt's last) sits at
        position `n - 1`, and every later one past the full prompt; return the shift (the
        prompt tokens skipped)."""
        assert self.kept is not None and self.done
        shift = len(self._tokens) - len(self.kept)
        for layer in self.cache:
            layer.shift = shift
        return shift

    def _score_chunk(self, limit: int) -> int:
        assert self._scorer_cache is not None
        n = len(self._tokens)
        window_start = n - SCORING_QUERIES
        if self._scored < window_start:
            end = min(window_start, self._scored + limit)
            self._scorer(self._prompt[self._scored : end][None], cache=self._scorer_cache)
            mx.eval([c.state for c in self._scorer_cache])
            scored, self._scored = end - self._scored, end
            mx.clear_cache()
            return scored
        _recording.scores = []
        try:
            self._scorer(self._prompt[window_start:][None], cache=self._scorer_cache)
            layers = _recording.scores
        finally:
            _recording.scores = None
        scores = mx.sum(mx.stack(layers), axis=0) if layers else mx.zeros((n,))
        mx.eval(scores)
        self._scorer_cache = None  # free the scorer's KV cache before the target runs
        kept = select_positions(scores, self._keep_pct, self._backbone_pct)
        self.kept = kept
        self._runs = _runs(kept)
        self._counters.requests += 1
        self._counters.prompt_tokens += n
        self._counters.kept_tokens += len(kept)
        return n - window_start

    def _prefill_run(self, limit: int) -> int:
        """Up to `limit` kept tokens of the next run of consecutive positions, in one pass."""
        start, end = self._runs[0]
        end = min(end, start + limit)
        for layer in self.cache:
            layer.shift = start - self.fed
        self._model(self._prompt[start:end][None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        mx.clear_cache()
        n = end - start
        self.fed += n
        if end == self._runs[0][1]:
            self._runs.pop(0)
        else:
            self._runs[0] = (end, self._runs[0][1])
        return n

    def _prefill_positioned(self, limit: int) -> int:
        """Up to `limit` kept tokens (not the prompt's last) in one pass, each at its position."""
        assert self.kept is not None
        todo = len(self.kept) - 1 - self.fed
        n = min(limit, todo)
        positions = self.kept[self.fed : self.fed + n]
        for layer in self.cache:
            layer.shift = 0
        with chunk_positions(positions):
            self._model(self._prompt[mx.array(positions, dtype=mx.uint32)][None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        mx.clear_cache()
        self.fed += n
        if self.fed == len(self.kept) - 1:
            self._runs = []
        return n


# ---- the sequence (serialized route) -----------------------------------------------------------


class SpecPrefillSequence:
    """One serialized-route generation of a long prompt with a sparse prefill (see the module).

    `snapshot_safe` is False: the runner stores nothing of it in the prefix cache."""

    snapshot_safe = False

    def __init__(
        self,
        job: GenerationJob,
        model: Any,
        scorer: Any,
        settings: SpecPrefillSettings,
        counters: SpecPrefillCounters,
        eos_token_ids: frozenset[int],
        *,
        vocab_size: int,
        chunk_tokens: int,
    ) -> None:
        self.job = dataclasses.replace(job, store_points=())
        self._model = model
        self._eos = eos_token_ids
        self._vocab_size = vocab_size
        self._chunk_tokens = chunk_tokens
        self._counters = counters
        self._sparse = SparsePrefill.for_job(job, model, scorer, settings, counters)
        self._decoder: ActiveSequence | None = None
        self.cached_tokens = 0
        self.finished = False

    # ActiveSequence's interface ------------------------------------------------------------

    @property
    def in_prefill(self) -> bool:
        return self._decoder is None or self._decoder.in_prefill

    @property
    def cache(self) -> list[Any]:
        return self._sparse.cache

    @property
    def prefill_done(self) -> bool:
        return self._decoder is not None and self._decoder.prefill_done

    @property
    def kept_positions(self) -> list[int] | None:
        """The prompt positions the target prefills, once scoring is done."""
        return self._sparse.kept

    def fed_tokens(self) -> tuple[int, ...]:
        if self._decoder is not None:
            return self._decoder.fed_tokens()
        if self._sparse.kept is None:
            return ()
        return self._sparse.kept_tokens()[: self._sparse.fed]

    def step(self, prefill_limit: int | None = None) -> StepResult:
        """One scoring chunk, one sparse prefill chunk, or the plain route's step."""
        if self._decoder is not None:
            result = self._decoder.step(prefill_limit)
            self.finished = self._decoder.finished
            return result
        if not self._sparse.done:
            limit = prefill_limit if prefill_limit is not None else self._chunk_tokens
            scoring = self._sparse.scoring
            n = self._sparse.step(limit)
            return StepResult(prefilled=0 if scoring else n)
        began = time.perf_counter()
        self._start_decoding()
        assert self._decoder is not None
        result = self._decoder.step(prefill_limit)
        self._counters.sparse_prefill_seconds += time.perf_counter() - began
        self.finished = self._decoder.finished
        return result

    def _start_decoding(self) -> None:
        self._sparse.finish()  # the last kept token sits at position n - 1
        kept_job = dataclasses.replace(self.job, prompt_tokens=self._sparse.kept_tokens())
        self._decoder = ActiveSequence(
            kept_job,
            self._model,
            self._eos,
            PrefillPlan(max(1, self._chunk_tokens)),
            vocab_size=self._vocab_size,
            cache=self._sparse.cache,
            cached_tokens=self._sparse.fed,  # >= SCORING_QUERIES - 1: the tail is always kept
            split_at_store_points=False,
        )
