"""A request with media on its way into the decode batch. Runner thread only.

On the batched route a request with images or video used to step beside the batch for its whole
life (`actors.media_lane`): a forward pass of its own every step, however many such requests ran.
Two things kept it out of the batch: its prompt goes through the language model as merged input
embeddings (on an MRoPE model, the Qwen-VL family, with position ids of three axes), and on an
MRoPE model the tokens after its prompt sit at `cache offset + rope delta`, a delta of its own.
Neither needs a forward pass of its own: its prompt's chunks can go through
`PromptEmbeddingModel` (the merged embeddings and the model's own positions) on its own cache
like any prefill chunk, and every position after its prompt is a text position, which the fused
rope places at any per-row delta (`text_rope`, `TextView(..., row_deltas=)`). So such a
request:

1. takes its vision step in the media lane (the tower, or its features from the
   `VisionFeatureCache`: a step of its own, so an abort takes effect right after it): a
   `JoiningMediaSequence` over a `BatchSequence` (`BatchDecoder.sequence`);
2. is then admitted to the batch (`BatchDecoder.admit`), its `prefill_model` its merged
   embeddings and its `rope_delta` set: it prefills as any arrival does, a chunk a step under the
   batch's one budget and in admission order (never in a group pass), joins when ready, its last
   prompt token its first input, and decodes in the batch's one forward pass from there. Alone
   in the batch it takes its lane's path instead (`engine.batch_lone_media`): its first token
   from its prompt's last pass, its steps through its `prefill_model` while nothing else
   decodes, so that one user alone pays nothing for joining.

A language model without MRoPE (LLaVA's llama, and any other whose module has no
`_rope_deltas`) never had the second obstacle: it places every token, the prompt's merged
embeddings included, at its cache offset, as a text model does, so a row continuing such a prompt
has no rope delta (`rope_delta` stays 0) and the batch's plain forward pass places it exactly
where the lane's own decode did (`PromptEmbeddingModel` called the same language model at the
same cache offsets). Such a request joins the same way.

Its prefix-cache keys are its prompt in cache-key ids (`BatchSequence.key_tokens`: media
positions in ids of the media's hash), so snapshots are stored and found as the lane's are.
Which requests join (`can_join`): on a language model without MRoPE (no rope delta), or on an
MRoPE model whose text positions take the fused rope (where it agrees with mlx-vlm's rotation:
`TextView.places_rows`), a prompt that ends with a text token (its last token is fed as text), a
cache the batch can merge. Others stay in the lane to the end: on an MRoPE model without the
fused rope the batch cannot place a row at `cache offset + rope delta`; requests mlx-vlm's
drafter serves stay there too.
"""

from __future__ import annotations

from typing import Any

from trio_mlx.engine.batch_layout import batchable
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.generation_job import GenerationJob, StepResult
from trio_mlx.multimodal.job import MultimodalJob, PromptEmbeddingModel
from trio_mlx.multimodal.loading import VisionLanguageModel
from trio_mlx.multimodal.vision import VisionFeatureCache, embed_prompt


def can_join(job: MultimodalJob, vlm: VisionLanguageModel, model: Any) -> bool:
    """Whether `job` can join the decode batch once prefilled (module docstring), before its
    cache is known; `model` is the batch's (the VLM's `TextView`): its language model places
    the row right if it is not an MRoPE model (no rope delta) or takes the fused rope."""
    media = {vlm.processing.image_token_id, vlm.processing.video_token_id}
    mrope = hasattr(getattr(model, "language_model", None), "_rope_deltas")
    return (
        (not mrope or bool(getattr(model, "places_rows", False)))
        and bool(job.prompt_tokens)
        and job.prompt_tokens[-1] not in media
    )


def cache_can_join(seq: BatchSequence) -> bool:
    """Whether `seq`'s own cache can be merged into the batch's."""
    return seq.cache is not None and batchable(seq.cache)


class JoiningMediaSequence:
    """A request with media in the media lane for its vision step (module docstring): the
    lane's interface (`step`, `in_prefill`, `prefill_done`, `cached_tokens`, `cache`,
    `fed_tokens`), with `encoded` and `sequence` for the hand-off."""

    def __init__(
        self,
        seq: BatchSequence,
        vlm: VisionLanguageModel,
        vision_cache: VisionFeatureCache,
    ) -> None:
        self.sequence = seq
        self.job: GenerationJob = seq.job
        self._vlm = vlm
        self._vision_cache = vision_cache

    @property
    def in_prefill(self) -> bool:
        return True

    @property
    def prefill_done(self) -> bool:
        return False

    @property
    def encoded(self) -> bool:
        """Its media are encoded: its sequence can prefill in the batch."""
        return self.sequence.prefill_model is not None

    @property
    def cached_tokens(self) -> int:
        return self.sequence.cached_tokens

    @property
    def cache(self) -> list[Any]:
        assert self.sequence.cache is not None  # its own until it joins the batch
        return self.sequence.cache

    @property
    def generated(self) -> int:
        return 0

    def fed_tokens(self) -> tuple[int, ...]:
        """What its cache holds, in cache-key ids."""
        return self.sequence.fed_tokens()

    def step(self, prefill_limit: int | None = None) -> StepResult:
        """The vision step: its prompt's embeddings, its sequence's `prefill_model` and
        `rope_delta` (`prefill_limit` unused: its prefill is the batch's)."""
        seq = self.sequence
        job = self.job
        assert isinstance(job, MultimodalJob) and job.vision is not None
        embeddings = embed_prompt(self._vlm, job.prompt_tokens, job.vision, self._vision_cache)
        if embeddings.rope_deltas is not None:
            seq.rope_delta = int(embeddings.rope_deltas.reshape(-1)[0].item())
        seq.prefill_model = PromptEmbeddingModel(self._vlm, embeddings)
        return StepResult()
