"""Self-speculative decoding: the target's own first layers draft for it (`--draft-layers N`).

A draft model costs a second model's memory and needs one that shares the target's tokenizer.
A self-draft needs neither: the draft is the target cut after its first `N` transformer layers,
then the target's own final norm and output head (early exit, as in Draft & Verify, Zhang et
al. 2023, and LayerSkip, Elhoushi et al. 2024). It shares every weight with the target (no copy:
the cut model's modules are the target's), and keeps a KV cache of its own for its `N` layers
(`N / L` of the target's KV memory a sequence). Verification is the target's as with any draft
(`engine/speculative.py`), so the output stays the target's, token for token under greedy
decoding and in distribution when sampled: only the speed depends on how often the early exit
agrees with the whole model.

That agreement depends on the checkpoint. Models trained with early-exit losses (LayerSkip
checkpoints) agree often at a few layers; other models need more of their layers for the exit to
agree, and a cut too shallow to agree costs its draft steps for nothing (the engine's
`acceptance_rate` in `/v1/status` says how a setting does). On a GPU where a decode step is bound
by launching kernels, a draft step costs about `N / L` of a target step.

`first_layers` cuts any mlx-lm model whose layers live in `model.model.layers` and whose forward
pass runs them in order (llama, qwen2/3, mistral, phi3, gemma...); a model of another layout,
or whose cut cannot run (a layer schedule indexed past the cut), is refused with a clear error.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import mlx.core as mx

from trio_mlx.engine.loading import LoadedModel
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.errors import ModelLoadError

__all__ = ["first_layers", "layer_count", "self_draft"]


def layer_count(model: Any) -> int | None:
    """Transformer layers of an mlx-lm model laid out as `model.model.layers`, else None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return len(layers) if isinstance(layers, list) else None


def first_layers(model: Any, n: int) -> Any:
    """`model` cut after its first `n` layers: the same embedding, layers, final norm and head
    (shared, not copied), a cache of `n` layers. Raises `ModelLoadError` where it cannot."""
    total = layer_count(model)
    if total is None:
        raise ModelLoadError(
            f"{type(model).__module__}: its layers are not where a self-draft can cut them "
            "(model.model.layers); use a draft model instead"
        )
    if not 1 <= n < total:
        raise ModelLoadError(f"draft layers must be from 1 to {total - 1} for this model, not {n}")
    inner = copy.copy(model.model)
    dict.__setitem__(inner, "layers", model.model.layers[:n])
    cut = copy.copy(model)
    dict.__setitem__(cut, "model", inner)
    cache = make_cache(cut)
    if len(cache) != n:
        raise ModelLoadError(
            f"{type(model).__module__}: its cache is not one entry a layer; "
            "a self-draft cannot cut it"
        )
    try:
        mx.eval(cut(mx.array([[0]], dtype=mx.uint32), cache=cache))
    except Exception as exc:
        raise ModelLoadError(
            f"{type(model).__module__}: its first {n} layers cannot run alone ({exc})"
        ) from exc
    return cut


def self_draft(target: LoadedModel, n: int) -> LoadedModel:
    """The draft of `--draft-layers n`: `target` with its model cut after `n` layers."""
    return dataclasses.replace(
        target, model=first_layers(target.model, n), name=f"{target.name} (first {n} layers)"
    )
