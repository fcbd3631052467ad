"""Requests with media decoded through mlx-vlm's speculative loop, with an mlx-vlm drafter.

A vision-language model served with `EngineConfig.mllm_draft_model` (`--mllm-draft-model`) loads
that drafter through mlx-vlm (`load_media_drafter`: `mlx_vlm.speculative.drafters.load_drafter`,
its kind resolved by mlx-vlm when `mllm_draft_kind` is None: DFlash, EAGLE-3 or MTP drafters,
e.g. a `qwen3_dflash` or `qwen3_5_mtp` checkpoint for a Qwen3.5 target). At load the pair is
checked by mlx-vlm (`validate_drafter_compatibility`) and then by one short drafted generation on
a few text tokens, so a drafter the target cannot feed (a target whose language model does not
return the hidden states the drafter reads, a hidden size that does not match) fails the load
with `ModelLoadError` naming both, not the first request.

A request with media whose sampling the drafted loop honours (`MediaDrafter.declines` is None)
then runs as a `DraftedMultimodalSequence`: mlx-vlm's `generate_step(..., draft_model=,
draft_kind=, draft_block_size=)` (the vision tower, the prompt's prefill with the hidden states
the drafter needs, then draft-and-verify rounds), stepped one token per runner step: an abort
takes the sequence out at the next step boundary and dropping it closes mlx-vlm's generator.
What it does not do, against the plain media route (`multimodal.job.MultimodalSequence`):
- its first step is the whole vision encoding and prefill and the first token (mlx-vlm's
  generator yields nothing before), so an abort during it takes effect after it, and the prefill
  pacer does not cut it (mlx-vlm chunks it by `prefill_step_size` inside that one step);
- it neither uses nor fills the prefix cache or the vision feature cache (mlx-vlm owns the KV
  cache, which after rejected drafts it rolls back itself): `snapshot_safe` is False;
- logprobs, logit bias, repetition / presence / frequency penalties, logits processors and
  grammars are not taken by mlx-vlm's speculative rounds: a request asking for any of them, or
  sampling (temperature > 0) with a drafter mlx-vlm runs greedily only, takes the plain route.
Temperature, top_p, top_k, min_p and seed go to mlx-vlm's sampler; greedy output equals the
plain route's (speculative decoding is lossless), sampled output is drawn by mlx-vlm's rules.
Text-only requests never come here (`runner._multimodal_sequence` only sees requests with media).
Runner thread only (MLX arrays).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trio_mlx.config import MLLM_DRAFT_KINDS
from trio_mlx.engine.generation_job import StepResult
from trio_mlx.engine.model_spec import resolve_model_path
from trio_mlx.errors import ModelLoadError
from trio_mlx.multimodal.job import MultimodalJob, MultimodalSequence
from trio_mlx.multimodal.loading import VisionLanguageModel

log = logging.getLogger(__name__)

#: The drafter kinds mlx-vlm's speculative loop runs (`mlx_vlm.speculative.drafters`).
DRAFT_KINDS = MLLM_DRAFT_KINDS

#: Text tokens of the load-time check: one short drafted generation (ids every vocabulary has).
_CHECK_PROMPT = (1, 2, 3, 4)


@dataclass(frozen=True)
class MediaDrafter:
    """A loaded mlx-vlm drafter for the vision-language model's requests with media: `model`
    (MLX arrays, runner thread only), the round-loop `kind` mlx-vlm resolved, the
    `block_size` override (None: the drafter's own) and the `name` it was loaded as."""

    model: Any
    kind: str
    block_size: int | None
    name: str

    def declines(self, job: MultimodalJob) -> str | None:
        """Why `job` takes the plain media route instead of the drafted one, or None."""
        params = job.params
        if job.logits_processors or job.grammar is not None:
            return "logits processors or a grammar"
        if params.logprobs:
            return "logprobs"
        if (
            params.logit_bias
            or params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        ):
            return "logit bias or penalties"
        if params.temperature > 0 and getattr(self.model, "requires_greedy_sampling", False):
            return "sampling with a greedy-only drafter"
        return None


def load_media_drafter(
    vlm: VisionLanguageModel,
    spec: str | Path,
    kind: str | None = None,
    block_size: int | None = None,
) -> MediaDrafter:
    """Load the drafter `spec` (a local directory, or a Hugging Face repo id in the local cache:
    nothing is downloaded) for `vlm` through mlx-vlm, and check the pair (see the module).

    `kind` None lets mlx-vlm resolve it from the drafter's config; a `kind` that the drafter's
    model type contradicts is overridden by mlx-vlm (logged). Raises `ModelLoadError`.
    """
    if kind is not None and kind not in DRAFT_KINDS:
        raise ModelLoadError(f"unknown mllm draft kind {kind!r}: one of {', '.join(DRAFT_KINDS)}")
    resolved = resolve_model_path(spec)
    try:
        from mlx_vlm.speculative.drafters import load_drafter

        drafter, resolved_kind = load_drafter(str(resolved.path), kind=kind)
    except Exception as exc:
        raise ModelLoadError(f"{resolved.path}: cannot load the mlx-vlm drafter: {exc}") from exc
    if kind is not None and resolved_kind != kind:
        log.warning(
            "drafter %s needs draft kind %r (not %r): using %r",
            resolved.name,
            resolved_kind,
            kind,
            resolved_kind,
        )
    target = vlm.processing.model_type
    try:
        from mlx_vlm.speculative.drafters import validate_drafter_compatibility

        validate_drafter_compatibility(vlm.model, drafter, resolved_kind)
        _check_drafted_generation(vlm, drafter, resolved_kind, block_size)
    except Exception as exc:
        raise ModelLoadError(
            f"{resolved.path}: mlx-vlm cannot draft for this {target} model with this "
            f"{resolved_kind} drafter: {type(exc).__name__}: {exc}"
        ) from exc
    log.info(
        "requests with media decode with the mlx-vlm %s drafter %s (block size %s)",
        resolved_kind,
        resolved.name,
        block_size if block_size is not None else "the drafter's",
    )
    return MediaDrafter(drafter, resolved_kind, block_size, resolved.name)


def _check_drafted_generation(
    vlm: VisionLanguageModel, drafter: Any, kind: str, block_size: int | None
) -> None:
    """Two greedy tokens of a drafted generation on a few text tokens (raises what it raises)."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    prompt = mx.array([list(_CHECK_PROMPT)], dtype=mx.int32)
    steps = generate_step(
        prompt,
        vlm.model,
        None,
        None,
        max_tokens=2,
        temperature=0.0,
        draft_model=drafter,
        draft_kind=kind,
        draft_block_size=block_size,
    )
    for _ in zip(range(2), steps, strict=False):
        pass
    steps.close()


class DraftedMultimodalSequence:
    """One request with media decoded by mlx-vlm's speculative loop (see the module). The
    interface the runner's routes drive (`decode.ActiveSequence`'s), one token a step."""

    #: mlx-vlm owns the KV cache: nothing of it is snapshotted into the prefix cache
    snapshot_safe = False

    def __init__(
        self,
        job: MultimodalJob,
        vlm: VisionLanguageModel,
        drafter: MediaDrafter,
        eos_token_ids: frozenset[int],
        *,
        prefill_step_size: int,
    ) -> None:
        if job.vision is None:
            raise ValueError("a multimodal job needs its vision inputs")
        self.job = job
        self._vlm = vlm
        self._drafter = drafter
        self._eos = eos_token_ids
        self._prefill_step_size = prefill_step_size
        self.cached_tokens = 0
        self._steps: Iterator[tuple[Any, Any]] | None = None
        self._tokens: list[int] = []
        self._prefilled = False
        self._finished = False

    @property
    def in_prefill(self) -> bool:
        return not self._prefilled

    @property
    def prefill_done(self) -> bool:
        return self._prefilled

    @property
    def cache(self) -> list[Any]:
        raise RuntimeError("a drafted media request's KV cache is mlx-vlm's own")

    @property
    def generated(self) -> int:
        return len(self._tokens)

    @property
    def finished(self) -> bool:
        return self._finished

    def fed_tokens(self) -> tuple[int, ...]:
        """The prompt (in cache-key ids) and the tokens generated so far."""
        if not self._prefilled:
            return ()
        return (self.job.cache_key or self.job.prompt_tokens) + tuple(self._tokens)

    def _start(self) -> Iterator[tuple[Any, Any]]:
        import mlx.core as mx
        from mlx_vlm.generate.ar import generate_step

        assert self.job.vision is not None
        arrays: dict[str, Any] = {
            k: mx.array(v) for k, v in self.job.vision.arrays.items() if v is not None
        }
        pixels = arrays.pop("pixel_values", None)
        if pixels is None:  # a video: mlx-vlm's models take its pixels in either place
            pixels = arrays.get("pixel_values_videos")
        arrays.pop("attention_mask", None)
        params = self.job.params
        return generate_step(
            mx.array([list(self.job.prompt_tokens)], dtype=mx.int32),
            self._vlm.model,
            pixels,
            None,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            prefill_step_size=self._prefill_step_size,
            draft_model=self._drafter.model,
            draft_kind=self._drafter.kind,
            draft_block_size=self._drafter.block_size,
            **arrays,
        )

    def step(self, prefill_limit: int | None = None) -> StepResult:
        """The next token (the first step: vision, prefill and the first token). `prefill_limit`
        is not used: mlx-vlm prefills the prompt in its first step."""
        del prefill_limit
        if self._finished:
            raise RuntimeError("step() after the sequence finished")
        prefilled = 0
        if self._steps is None:
            self._steps = self._start()
            prefilled = len(self.job.prompt_tokens)
        try:
            token = int(next(self._steps)[0])
        except StopIteration:
            return self._finish("length", (), prefilled)
        self._prefilled = True
        if token in self._eos:
            return self._finish("stop", (), prefilled)
        self._tokens.append(token)
        if len(self._tokens) >= self.job.params.max_tokens:
            return self._finish("length", (token,), prefilled)
        return StepResult(tokens=(token,), prefilled=prefilled)

    def _finish(self, reason: str, tokens: tuple[int, ...], prefilled: int) -> StepResult:
        self._finished = True
        self._prefilled = True
        if self._steps is not None:
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()
        return StepResult(tokens=tokens, finish=reason, prefilled=prefilled)


#: A request with media on either route: plain (`MultimodalSequence`) or drafted.
MediaSequence = MultimodalSequence | DraftedMultimodalSequence
