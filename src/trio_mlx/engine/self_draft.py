"""Self-speculative decoding: the target's own layers draft for it (`--draft-layers`).

A draft model costs a second model's memory and needs one that shares the target's tokenizer.
A self-draft needs neither: the draft is the target cut after its first `N` transformer layers,
then the target's own final norm and output head (early exit, as in LayerSkip, Elhoushi et al.
2024). It shares every weight with the target (no copy:
the cut model's modules are the target's), and keeps a KV cache of its own for its `N` layers
(`N / L` of the target's KV memory a sequence). Verification is the target's as with any draft
(`engine/speculative.py`), so the output stays the target's, token for token under greedy
decoding and in distribution when sampled: only the speed depends on how often the early exit
agrees with the whole model.

The draft may also keep any ascending subset of the layers rather than the first `N`
(`--draft-layers 0-11,16-29`: layers skipped in the middle, as in Draft & Verify, Zhang et al.
2023, where the first and last layers matter most): `DraftLayers` is either.

That agreement depends on the checkpoint. Models trained with early-exit losses (LayerSkip
checkpoints) agree often at a few layers; other models need most of their layers for the draft
to agree, and a draft too shallow to agree costs its steps for nothing (the engine's
`acceptance_rate` in `/v1/status` says how a setting does). Measured on the bundled
SmolLM2-135M (30 layers, float32, `bench.draft_agreement`: top-1 agreement with the whole model
on its own greedy continuations): the first 8 layers 0.03, 15 0.08, 22 0.23, 26 0.37, 28 0.50;
all but 13-16 (26 layers) 0.56, all but 14-15 (28) 0.66. On a GPU where a decode step is bound
by launching kernels, a draft step costs about its share of the layers of a target step.

`cut_model` cuts an mlx-lm model whose layers live in `model.model.layers` and whose forward
pass runs them in order (llama, tested here, and the models laid out like it); a model of another
layout, or whose cut cannot run (a layer schedule indexed past the cut), is refused with a clear
error.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import mlx.core as mx

from trio_mlx.engine.loading import LoadedModel
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.errors import ModelLoadError

__all__ = [
    "DraftLayers",
    "cut_model",
    "describe_layers",
    "kept_layers",
    "layer_count",
    "parse_layers",
    "self_draft",
]

#: The draft's layers: the first N, or the indices kept, ascending.
DraftLayers = int | tuple[int, ...]


def parse_layers(text: str) -> DraftLayers:
    """`--draft-layers`: `N` (the first N layers), or indices and inclusive ranges joined by
    commas (`0-11,16-29`). Raises ValueError on anything else, or on indices not ascending."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    kept: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(
                f"draft layers {text!r}: expected N, or indices and ranges like 0-11,16-29"
            )
        kept.extend(range(int(low), int(high if dash else low) + 1))
    if not kept or any(b <= a for a, b in itertools.pairwise(kept)):
        raise ValueError(f"draft layers {text!r}: the layers must be ascending, each once")
    return tuple(kept)


def kept_layers(layers: DraftLayers, total: int) -> tuple[int, ...]:
    """The layer indices `layers` keeps of a model of `total` layers; ModelLoadError unless it
    keeps at least one and fewer than all, all of them the model's."""
    kept = tuple(range(layers)) if isinstance(layers, int) else layers
    if isinstance(layers, int) and not 1 <= layers < total:
        raise ModelLoadError(
            f"draft layers must be from 1 to {total - 1} for this model, not {layers}"
        )
    if not kept or len(kept) >= total or kept[0] < 0 or kept[-1] >= total:
        raise ModelLoadError(
            f"draft layers must keep some of this model's layers 0-{total - 1}, not all: {kept}"
        )
    return kept


def describe_layers(layers: DraftLayers) -> str:
    """`layers` as `--draft-layers` spells it (`6`, `0-11,16-29`)."""
    if isinstance(layers, int):
        return str(layers)
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def layer_count(model: Any) -> int | None:
    """Transformer layers of an mlx-lm model laid out as `model.model.layers`, else None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return len(layers) if isinstance(layers, list) else None


def cut_model(model: Any, layers: DraftLayers) -> Any:
    """`model` with only `layers` (the first N, or the indices kept): the same embedding,
    layers, final norm and head (shared, not copied), a cache of one entry a kept layer.
    Raises `ModelLoadError` where it cannot."""
    total = layer_count(model)
    if total is None:
        raise ModelLoadError(
            f"{type(model).__module__}: its layers are not where a self-draft can cut them "
            "(model.model.layers); use a draft model instead"
        )
    kept = kept_layers(layers, total)
    n = len(kept)
    inner = copy.copy(model.model)
    dict.__setitem__(inner, "layers", [model.model.layers[i] for i in kept])
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
            f"{type(model).__module__}: draft layers {describe_layers(layers)} cannot run "
            f"alone ({exc})"
        ) from exc
    return cut


def self_draft(target: LoadedModel, layers: DraftLayers) -> LoadedModel:
    """The draft of `--draft-layers`: `target` with only those of its layers."""
    name = (
        f"first {layers} layers" if isinstance(layers, int) else f"layers {describe_layers(layers)}"
    )
    return dataclasses.replace(
        target, model=cut_model(target.model, layers), name=f"{target.name} ({name})"
    )
