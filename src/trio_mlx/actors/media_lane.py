"""Requests with media on the batched route: a lane of their own beside the decode batch.

On a vision-language model with `max_num_seqs > 1`, text-only requests go through the language
model (`multimodal.loading.TextView`) and decode together in the batch like a text model's. A
request with images or video takes its vision step here, beside the batch, and then prefills and
decodes in the batch (`multimodal.joining`: a `JoiningMediaSequence` here for its vision step,
then `BatchDecoder.admit`) when the batch's forward pass places its tokens where its own decode
would: on a language model without MRoPE (LLaVA's llama, ...: every token at its cache offset,
no rope delta), or on an MRoPE model (the Qwen-VL family) whose text positions take the fused
rope (`multimodal.text_rope`: rows at `cache offset + rope delta`). Otherwise it stays here to
the end: on an MRoPE model without the fused rope, the batch's one forward pass cannot place a
row at `cache offset + rope delta` (a delta of its own: the media's positions are compressed into
a grid, so it is negative; `TextView` gives every row the delta 0); a prompt that ends with a
media token has no text token to join with; a request mlx-vlm's drafter serves runs mlx-vlm's
own loop.

So each of those is a `MultimodalSequence` with its own KV cache, stepped here once per loop of
the batched route, after the batch's decode step and before its prefill chunk, exactly as the
serialized route steps it: its first step is the vision encoding, then prefill chunks under the
pacer's budget (the one the batch's own prefill gets, so decoding rows are not stalled longer
than by a batch prefill chunk), then one decode token a step. Nothing waits in a queue: media
requests and batched text requests advance together, step for step; admission
(`max_num_seqs`) counts them all. An abort takes the sequence out at the next step boundary
and never touches the batch (its cache is its own). With an mlx-vlm drafter
(`EngineConfig.mllm_draft_model`), a request with media may instead be a
`multimodal.drafted.DraftedMultimodalSequence`, stepped here the same way: its first step is
mlx-vlm's vision encoding, whole prefill and first token, then a token a step; its cache is
mlx-vlm's and is never snapshotted.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from trio_mlx.actors.kv_cache import CacheKind
from trio_mlx.actors.runner_protocol import SequenceEvent
from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.multimodal.drafted import MediaSequence
from trio_mlx.multimodal.job import MultimodalJob
from trio_mlx.multimodal.joining import JoiningMediaSequence, cache_can_join, can_join

if TYPE_CHECKING:
    from trio_mlx.actors.runner import Runner
    from trio_mlx.engine.loading import LoadedModel

log = logging.getLogger(__name__)

Stores = list[tuple[Any, CacheKind, int | None]]


class MediaLane:
    """The live requests with media on the batched route (see the module)."""

    def __init__(self, runner: Runner, loaded: LoadedModel, batch: BatchDecoder) -> None:
        self._runner = runner
        self._loaded = loaded
        self._batch = batch
        self._live: dict[int, MediaSequence | JoiningMediaSequence] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, job: MultimodalJob) -> None:
        """Start `job` from its longest cached prefix (raises if it cannot start)."""
        runner = self._runner
        vocab = runner.info.vocab_size if runner.info is not None else len(self._loaded.tokenizer)
        joining = self._joining if self._joins(job) else None
        self._live[job.request_id] = runner._media_sequence(job, self._loaded, vocab, joining)
        runner.counters.media = len(self._live)

    def _joins(self, job: MultimodalJob) -> bool:
        vlm = self._loaded.multimodal
        return vlm is not None and can_join(job, vlm, self._loaded.model)

    def _joining(
        self, job: MultimodalJob, cache: list[Any] | None, cached_tokens: int
    ) -> JoiningMediaSequence | None:
        """`job` as a sequence that will join the batch, or None where its cache cannot."""
        vlm = self._loaded.multimodal
        assert vlm is not None
        seq = self._batch.sequence(job, cache, cached_tokens, key_tokens=job.keyed().prompt_tokens)
        if not cache_can_join(seq):
            return None
        return JoiningMediaSequence(seq, vlm, self._runner.vision_cache)

    def remove(self, request_id: int, *, store: bool) -> bool:
        """Take a request out (an abort); snapshot what its cache holds when `store` and its
        prefill completed. Whether it was here."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return False
        self._runner.counters.media = len(self._live)
        if store and seq.prefill_done:
            self._runner._snapshots.store(seq, "conversation")
        return True

    def step(
        self, decoding: int, waiting: int, events: list[SequenceEvent], stores: Stores
    ) -> None:
        """One step of every live request with media: its events and snapshots are appended to
        `events` and `stores`. `decoding` / `waiting`: the batch's rows, for the pacer's prefill
        budget."""
        runner = self._runner
        counters = runner.counters
        pacer = runner.pacer
        for request_id, seq in list(self._live.items()):
            prefill = seq.in_prefill
            try:
                began = time.perf_counter()
                result = seq.step(pacer.chunk_tokens(decoding, waiting) if prefill else None)
                if prefill and not result.tokens and result.finish is None:
                    pacer.observe_chunk(result.prefilled, time.perf_counter() - began)
            except Exception as exc:
                log.exception("request %d failed inside the model", request_id)
                del self._live[request_id]
                counters.failed += 1
                error = f"{type(exc).__name__}: {exc}"
                events.append(
                    SequenceEvent(
                        request_id, finish="error", error=error, cached_tokens=seq.cached_tokens
                    )
                )
                continue
            counters.media_steps += 1
            counters.prompt_tokens += result.prefilled
            counters.generated_tokens += len(result.tokens)
            last = len(seq.job.prompt_tokens) - 1
            for point in result.store_points:
                stores.append((seq, "prompt" if point == last else "system", point))
            if result.finish is not None:
                del self._live[request_id]
                stores.append((seq, "conversation", None))
            elif isinstance(seq, JoiningMediaSequence) and seq.encoded:
                del self._live[request_id]  # it prefills and decodes in the batch from here
                self._batch.admit(seq.sequence)
                counters.media_joined += 1
            if result.tokens or result.finish is not None:
                events.append(
                    SequenceEvent(
                        request_id,
                        result.tokens,
                        result.finish,  # type: ignore[arg-type]
                        None,
                        result.logprobs,
                        seq.cached_tokens,
                    )
                )
        counters.media = len(self._live)
