"""Runner start-up: what the runner thread does once, before it serves its first request.

Two steps, both on the runner thread (they make MLX objects), with the runner's stop check
between them (a load cannot be interrupted; what follows it is skipped when the engine closed
meanwhile: see `Runner._run_thread`):
1. `load_models`: the target model (with its MTP head for native MTP), the draft model, the
   self-draft (the target's first layers: `engine/self_draft.py`) or the MTP drafter, and
   SpecPrefill's scoring model (the draft's own when both name the same model; the model's own
   layers where none is named: `specprefill_layers`), each checked against the target
   (`speculative.check_draft`); on a vision-language model, the mlx-vlm drafter of its requests
   with media (`multimodal.drafted`, checked by mlx-vlm and one short drafted generation).
   Raises the load's error (`ModelLoadError`), which `Runner.run` raises before `started`.
2. `prepare_serving`: the fast decode step (`fast_decode.prepare_fast_decode`: fused projections,
   quantized layers dequantizing for many rows, the traced step; none with a drafter, whose
   steps verify several tokens), the same routing for the scoring model, the `ModelInfo`,
   the prefill plan and its pacer (calibrated by the cache probe's timed pass), the traced step
   of small batches (`fast_decode.prepare_batch_step`), the KV bytes per token, the route
   (batched only for `max_num_seqs > 1`, a cache that can be merged and a text-only model) and
   the `Speculator`.

`StartOptions` is the runner's configuration for both, validated when the runner is made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trio_mlx.actors.model_info import ModelInfo, describe
from trio_mlx.engine.compiled_step import CompiledDecode
from trio_mlx.engine.decode import PrefillPlan
from trio_mlx.engine.fast_decode import (
    DEFAULT_TRACED_BATCH_ROWS,
    prepare_batch_step,
    prepare_fast_decode,
    prepare_lean_step,
)
from trio_mlx.engine.kernel_warmup import warm_few_rows_kernels, warm_quantized_kernels
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.engine.loading import LoadedModel
from trio_mlx.engine.model_probe import probe_cache
from trio_mlx.engine.mtp import MtpDrafter
from trio_mlx.engine.quantized_rows import apply_threshold
from trio_mlx.engine.scheduling import PrefillPacer
from trio_mlx.engine.self_draft import cut_model, self_draft
from trio_mlx.engine.speculative import Speculator, check_draft
from trio_mlx.errors import ModelLoadError
from trio_mlx.multimodal.drafted import load_media_drafter

log = logging.getLogger(__name__)

ModelLoader = Callable[[str | Path | None], LoadedModel]


@dataclass(frozen=True)
class StartOptions:
    """What the runner loads and how it prepares to serve (`Runner`'s arguments)."""

    model: str | Path | None
    loader: ModelLoader
    max_kv_size: int | None
    max_num_seqs: int
    prefill_step_size: int
    fused_tail_tokens: int | None
    prefill_block: int | None
    prefill_chunk_seconds: float
    compiled_decode: bool | None
    #: batches of 2 to this many rows take a traced step (None: the backend's default)
    traced_batch_rows: int | None
    fused_projections: bool | None
    #: a lone sequence's steps through the lean one-token step (None: the backend's default)
    lean_decode: bool | None
    #: rows from which quantized layers dequantize (`quantized_rows`; None: the backend's default)
    dequantize_from_rows: int | None
    draft_model: str | Path | None
    #: a self-draft: the target's first layers draft for it (`engine/self_draft.py`)
    draft_layers: int | tuple[int, ...] | None
    #: native MTP: the model's own multi-token-prediction head drafts (`engine/mtp.py`)
    mtp: bool
    #: tokens drafted a step (the MTP head's when `mtp`, else the draft model's)
    num_draft_tokens: int
    specprefill_model: str | Path | None
    #: an mlx-vlm drafter for the requests with media (`multimodal.drafted`), its kind (None:
    #: mlx-vlm's resolution) and block size (None: the drafter's)
    mllm_draft_model: str | Path | None = None
    mllm_draft_kind: str | None = None
    mllm_draft_block_size: int | None = None
    #: the model's own layers SpecPrefill scores with, where no scoring model is named
    specprefill_layers: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.mtp and self.draft_model is not None:
            raise ValueError("mtp and draft_model cannot be combined: one drafter at a time")


@dataclass(frozen=True)
class LoadedModels:
    """The models a runner serves with."""

    target: LoadedModel
    #: the draft model (a `LoadedModel`), the target's `MtpDrafter`, or None
    draft: Any
    #: the model SpecPrefill scores with, or None
    scorer: Any
    #: the mlx-vlm drafter of requests with media (`multimodal.drafted.MediaDrafter`), or None
    media_drafter: Any = None


@dataclass(frozen=True)
class ServingSetup:
    """What `prepare_serving` decided, for the runner to serve with."""

    info: ModelInfo
    #: the model's traced decode step, None when off or unsupported
    compiled: CompiledDecode | None
    prefill_plan: PrefillPlan
    pacer: PrefillPacer
    #: KV cache bytes per token of one sequence
    kv_bytes_per_token: int
    #: whether the batched route serves
    batching: bool
    speculator: Speculator | None
    #: the traced step of batches of 2 to `traced_batch_rows` rows (None: the plain step)
    batch_step: CompiledDecode | None = None
    traced_batch_rows: int = 0
    #: the lean one-token step of lone sequences, where no traced step serves (None: off)
    lean: LeanStep | None = None


def load_models(options: StartOptions) -> LoadedModels:
    """Load the target, the drafter and the scoring model (see the module docstring)."""
    loader = options.loader
    loaded = (
        loader(options.model, mtp=True)  # type: ignore[call-arg]
        if options.mtp
        else loader(options.model)
    )
    draft: Any = None
    if options.mtp:
        draft = MtpDrafter(loaded.model)
        check_draft(loaded, loaded, options.max_kv_size)  # the target's cache must trim
    elif options.draft_model is not None:
        draft = loader(options.draft_model)
        check_draft(loaded, draft, options.max_kv_size)
    elif options.draft_layers is not None:
        draft = self_draft(loaded, options.draft_layers)
        check_draft(loaded, draft, options.max_kv_size)
    scorer: Any = None
    if options.specprefill_model is not None:
        if options.specprefill_model == options.draft_model and draft is not None:
            scorer = draft.model
        else:
            scoring = loader(options.specprefill_model)
            check_draft(loaded, scoring, options.max_kv_size)
            scorer = scoring.model
    elif options.specprefill_layers is not None:
        scorer = cut_model(loaded.model, options.specprefill_layers)  # shares its weights
    media_drafter: Any = None
    if options.mllm_draft_model is not None:
        if loaded.multimodal is None:
            raise ModelLoadError(
                f"{loaded.path}: an mllm draft model needs a vision-language model "
                "(one loaded through mlx-vlm)"
            )
        media_drafter = load_media_drafter(
            loaded.multimodal,
            options.mllm_draft_model,
            options.mllm_draft_kind,
            options.mllm_draft_block_size,
        )
    return LoadedModels(loaded, draft, scorer, media_drafter)


def prepare_serving(models: LoadedModels, options: StartOptions) -> ServingSetup:
    """Prepare the loaded models to serve and choose how (see the module docstring)."""
    loaded, draft = models.target, models.draft
    if draft is not None and options.compiled_decode:
        log.info("compiled decode off: a draft model verifies several tokens a step")
    # With a draft, decode steps are the speculator's (several tokens a pass): no traced step.
    compiled_option = False if draft is not None else options.compiled_decode
    rows = options.dequantize_from_rows
    compiled = prepare_fast_decode(
        loaded.model, compiled_option, options.fused_projections, dequantize_from_rows=rows
    )
    lean = prepare_lean_step(loaded.model, options.lean_decode) if compiled is None else None
    if draft is not None and not options.mtp:  # a draft model's steps are launch-bound too
        prepare_fast_decode(
            draft.model, False, options.fused_projections, dequantize_from_rows=rows
        )
    if models.scorer is not None:  # scores whole prompts: many rows a pass
        apply_threshold(models.scorer, rows)
    for model in (loaded.model, getattr(draft, "model", None), models.scorer):
        if model is not None:  # CUDA compiles quantized products on first use: not in a request
            warm_quantized_kernels(model)
            warm_few_rows_kernels(model)
    info = describe(loaded, options.max_kv_size)
    plan = PrefillPlan.choose(
        options.prefill_step_size,
        tail=options.fused_tail_tokens,
        block=options.prefill_block,
        trimmable=info.cache_support is not None and info.cache_support.trimmable,
    )
    log.debug("prefill plan: %s", plan)
    pacer = PrefillPacer(plan.step, block=plan.block, target_seconds=options.prefill_chunk_seconds)
    kv_bytes_per_token, mergeable = probe_cache(loaded.model, options.max_kv_size, pacer)
    multimodal = loaded.multimodal is not None
    batching = options.max_num_seqs > 1 and mergeable
    speculator: Speculator | None = None
    if draft is not None:
        speculator = Speculator(
            loaded.model,
            draft if options.mtp else draft.model,
            num_draft_tokens=options.num_draft_tokens,
            catch_up_tokens=plan.step,
        )
        log.info(
            "speculative decoding with %s, %d draft tokens",
            "the model's MTP head" if options.mtp else draft.name,
            options.num_draft_tokens,
        )
    traced_rows = options.traced_batch_rows
    if traced_rows is None:
        traced_rows = DEFAULT_TRACED_BATCH_ROWS
    traced_rows = min(traced_rows, options.max_num_seqs) if batching and not multimodal else 0
    batch_step = prepare_batch_step(loaded.model, traced_rows, reuse=compiled)
    if options.max_num_seqs > 1 and not mergeable:
        log.warning("this model's KV cache cannot be batched: serving one sequence at a time")
    elif options.max_num_seqs > 1 and multimodal:
        log.info(
            "a vision-language model: text-only requests decode in the batch, requests "
            "with media one at a time beside it"
        )
    return ServingSetup(
        info=info,
        compiled=compiled,
        prefill_plan=plan,
        pacer=pacer,
        kv_bytes_per_token=kv_bytes_per_token,
        batching=batching,
        speculator=speculator,
        batch_step=batch_step,
        traced_batch_rows=traced_rows if batch_step is not None else 0,
        lean=lean,
    )
