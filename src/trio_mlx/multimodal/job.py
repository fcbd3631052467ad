"""A multimodal generation on the runner: a vision step, then prefill and decode as for text.

`MultimodalJob` is a `GenerationJob` that also carries the processor's arrays and the prompt's
cache key. `MultimodalSequence` presents the interface the runner's serialized route drives
(`decode.ActiveSequence`'s: `step`, `in_prefill`, `prefill_done`, `cache`, `fed_tokens`, ...):
- its first step runs the vision tower (or takes its features from the `VisionFeatureCache`) and
  merges them into the prompt's embeddings: a step of its own, so an abort that arrives during
  encoding takes effect right after it, before any prefill;
- then an `ActiveSequence` over `PromptEmbeddingModel` does the rest, unchanged: prefill chunks
  (sized by the runner's pacer), the first token, pipelined decode, sampling, logits processors.
  `PromptEmbeddingModel` feeds the language model the merged embeddings (and the model's own
  position ids) at prompt positions and plain token ids after them (text positions: the fused
  rope where the model took it, `text_rope`).
- `fed_tokens()` answers in cache-key ids (media positions replaced by ids derived from the
  media's hash: `prepare.MultimodalRequest.cache_key`), so the prefix cache stores and restores
  multimodal prompts exactly: a hit needs the same tokens and the same images before it.
Prefill blocks (CUDA's padded shapes) are off for these sequences: padding would need
embeddings past the prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trio_mlx.engine.decode import ActiveSequence, GenerationJob, PrefillPlan, StepResult
from trio_mlx.multimodal.loading import VisionLanguageModel, logits_of
from trio_mlx.multimodal.prepare import VisionInputs
from trio_mlx.multimodal.vision import PromptEmbeddings, VisionFeatureCache, embed_prompt


@dataclass(frozen=True)
class MultimodalJob(GenerationJob):
    """A `GenerationJob` with media: `vision` (the processor's arrays) and `cache_key` (the
    prompt in cache-key ids, as long as `prompt_tokens`)."""

    vision: VisionInputs | None = field(default=None, compare=False)
    cache_key: tuple[int, ...] = ()

    def keyed(self) -> GenerationJob:
        """The job as the prefix cache sees it (its prompt in cache-key ids)."""
        return dataclasses.replace(self, prompt_tokens=self.cache_key or self.prompt_tokens)


class PromptEmbeddingModel:
    """The language model as `ActiveSequence` calls it (`model(tokens, cache=c) -> logits`),
    for one multimodal prompt: positions inside the prompt take `embeddings` (and its position
    ids); positions after it take the tokens, placed by the rope delta."""

    def __init__(self, vlm: VisionLanguageModel, prompt: PromptEmbeddings) -> None:
        self._lm = vlm.language_model
        self._prompt = prompt
        self._length = int(prompt.embeds.shape[1])
        self._mrope = hasattr(self._lm, "_rope_deltas")
        self._text_rope = vlm.text_rope

    @property
    def layers(self) -> Any:
        return self._lm.layers

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self._lm)

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        # The first layer with a position: a hybrid model's recurrent layers (ArraysCache,
        # Qwen3.5's linear attention) have none.
        offset = next((int(c.offset) for c in cache or () if hasattr(c, "offset")), 0)
        n = int(tokens.shape[1])
        prompt = self._prompt
        if offset < self._length:
            if offset + n > self._length:
                raise ValueError("a multimodal prefill pass ran past the prompt")
            kwargs: dict[str, Any] = {}
            if prompt.position_ids is not None:
                kwargs["position_ids"] = prompt.position_ids[..., offset : offset + n]
            embeds = prompt.embeds[:, offset : offset + n]
            return logits_of(self._lm(tokens, inputs_embeds=embeds, cache=cache, **kwargs))
        kwargs = {}
        if self._mrope:
            self._lm._position_ids = None
        if prompt.rope_deltas is not None:
            kwargs["rope_deltas"] = prompt.rope_deltas
        if self._text_rope is None:
            return logits_of(self._lm(tokens, cache=cache, **kwargs))
        # past the prompt every token is text: its three positions are offset + rope delta
        with self._text_rope.text_positions():
            return logits_of(self._lm(tokens, cache=cache, **kwargs))


class MultimodalSequence:
    """One multimodal generation on the runner thread (see the module)."""

    def __init__(
        self,
        job: MultimodalJob,
        vlm: VisionLanguageModel,
        vision_cache: VisionFeatureCache,
        eos_token_ids: frozenset[int],
        prefill: PrefillPlan,
        *,
        vocab_size: int,
        max_kv_size: int | None = None,
        cache: list[Any] | None = None,
        cached_tokens: int = 0,
    ) -> None:
        if job.vision is None:
            raise ValueError("a multimodal job needs its vision inputs")
        self.job = job
        self._vlm = vlm
        self._vision_cache = vision_cache
        self._eos = eos_token_ids
        self._plan = dataclasses.replace(prefill, block=1)
        self._vocab_size = vocab_size
        self._max_kv_size = max_kv_size
        self._restored = cache
        self.cached_tokens = cached_tokens if cache is not None else 0
        self._inner: ActiveSequence | None = None

    @property
    def in_prefill(self) -> bool:
        return self._inner is None or self._inner.in_prefill

    @property
    def prefill_done(self) -> bool:
        return self._inner is not None and self._inner.prefill_done

    @property
    def cache(self) -> list[Any]:
        if self._inner is None:
            raise RuntimeError("no cache before the vision step")
        return self._inner.cache

    @property
    def generated(self) -> int:
        return 0 if self._inner is None else self._inner.generated

    @property
    def finished(self) -> bool:
        return self._inner is not None and self._inner.finished

    def fed_tokens(self) -> tuple[int, ...]:
        """What the cache holds, in cache-key ids (see the module)."""
        if self._inner is None:
            return ()
        fed = self._inner.fed_tokens()
        prompt = len(self.job.prompt_tokens)
        key = self.job.cache_key or self.job.prompt_tokens
        return key[: min(len(fed), prompt)] + fed[prompt:]

    def step(self, prefill_limit: int | None = None) -> StepResult:
        if self._inner is None:
            assert self.job.vision is not None
            embeddings = embed_prompt(
                self._vlm, self.job.prompt_tokens, self.job.vision, self._vision_cache
            )
            self._inner = ActiveSequence(
                self.job,
                PromptEmbeddingModel(self._vlm, embeddings),
                self._eos,
                self._plan,
                vocab_size=self._vocab_size,
                max_kv_size=self._max_kv_size,
                cache=self._restored,
                cached_tokens=self.cached_tokens,
                split_at_store_points=False,
            )
            self._restored = None
            return StepResult()
        return self._inner.step(prefill_limit)
