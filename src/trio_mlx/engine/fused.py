"""Fused projections: a layer's q/k/v projections as one matrix product, and its MLP's gate/up
projections as another, made at load time. Runner thread only.

Each projection of the same input is a matrix product of its own in mlx-lm's llama-family layers
(three for attention, two for the MLP): five kernels to launch per layer where two do, on a device
where a decode step is bound by launching kernels, not by computing them. `fuse_projections`
concatenates the weights along the output axis into one `Linear` (or `QuantizedLinear`: the
packed weights, scales and biases of each output row are independent, so they concatenate too, for
projections of one group size, bit width and mode), registered on the owning module as `qkv_proj`
/ `gate_up_proj`. The original attributes (`q_proj`, ...) become `_Part`s: plain callables (not
modules, so the weights are counted once) that return their slice of the one product. The
model's own code runs unchanged: the first part called with an input computes the fused product,
the others called with that same input object take their slice of it.

Only for the architectures whose forward pass calls those projections on one input
(`FUSABLE_MODULES`), and only where every projection of a group is a plain `Linear` or a
`QuantizedLinear` of matching quantization with the same input width (LoRA adapters or other
wrappers are left alone). The output is the same products, cut differently: on the CPU backend
in float32 the logits equal the plain model's; on a GPU the matrix kernels chosen for the wider
product may round differently.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.nn import Linear, QuantizedLinear  # type: ignore[attr-defined]

__all__ = ["FUSABLE_MODULES", "fuse_projections"]

FUSABLE_MODULES = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})

_GROUPS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
)


class _Shared:
    """The fused product of one input, handed out part by part."""

    __slots__ = ("_fused", "_input", "_parts", "_split_at", "_taken")

    def __init__(self, fused: Any, widths: list[int]) -> None:
        self._fused = fused
        self._split_at = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
        self._input: Any = None
        self._parts: list[Any] = []
        self._taken: list[bool] = []

    def part(self, x: Any, index: int) -> Any:
        if x is not self._input or self._taken[index]:
            self._parts = list(mx.split(self._fused(x), self._split_at, axis=-1))
            self._input = x
            self._taken = [False] * len(self._parts)
        self._taken[index] = True
        result = self._parts[index]
        if all(self._taken):  # every part handed out: hold nothing between calls
            self._input, self._parts = None, []
        return result


class _Part:
    """Stands in for one of the fused projections: its slice of the shared product."""

    __slots__ = ("_index", "_shared")

    def __init__(self, shared: _Shared, index: int) -> None:
        self._shared = shared
        self._index = index

    def __call__(self, x: Any) -> Any:
        return self._shared.part(x, self._index)


def fuse_projections(model: Any) -> int:
    """Fuse the q/k/v and gate/up projections of every layer of `model` in place (see the module
    docstring); return how many groups were fused (0: the architecture is not one of
    `FUSABLE_MODULES`, or no group qualified). Evaluates each layer's new weights before the next
    (the memory peak stays at one layer's projections), and returns the replaced weights' memory
    to the device (MLX's buffer cache emptied)."""
    kind = type(model)
    if kind.__name__ != "Model" or kind.__module__ not in FUSABLE_MODULES:
        return 0
    fused = 0
    for layer in getattr(model, "layers", ()):
        for owner_name, names, fused_name in _GROUPS:
            owner = getattr(layer, owner_name, None)
            if owner is not None and fused_name not in owner:
                fused += _fuse(owner, names, fused_name)
    if fused:
        # The replaced weights' buffers back to the device: MLX keeps freed buffers in its
        # cache, and those of an 8B bf16 model's q/k/v and gate/up projections are ~9 GB.
        mx.clear_cache()
    return fused


def _fuse(owner: Any, names: tuple[str, ...], fused_name: str) -> bool:
    """Fuse `owner`'s projections `names` into `fused_name` (module docstring); whether it did.
    Its own function so that nothing refers to the replaced weights once it returns."""
    projections = [owner.get(name) for name in names]
    joined = _concatenated(projections)
    if joined is None:
        return False
    mx.eval(joined.parameters())
    owner[fused_name] = joined
    shared = _Shared(joined, [int(p.weight.shape[0]) for p in projections])
    for index, name in enumerate(names):
        del owner[name]
        object.__setattr__(owner, name, _Part(shared, index))
    return True


def _concatenated(projections: list[Any]) -> Any:
    """One module computing every projection's output side by side, or None when they cannot be
    joined (not all plain `Linear`, or not all `QuantizedLinear` of one quantization; differing
    input widths; biases on some only)."""
    if any(p is None for p in projections):
        return None
    kinds = {type(p) for p in projections}
    with_bias = {"bias" in p for p in projections}
    if len(kinds) != 1 or len(with_bias) != 1:
        return None
    kind = kinds.pop()
    has_bias = with_bias.pop()
    names = {Linear: ("weight",), QuantizedLinear: ("weight", "scales", "biases")}.get(kind)
    if names is None:
        return None
    if kind is QuantizedLinear:
        if len({(p.group_size, p.bits, p.mode, "biases" in p) for p in projections}) != 1:
            return None
        if "biases" not in projections[0]:
            names = ("weight", "scales")
    if len({p.weight.shape[1:] for p in projections}) != 1:
        return None
    if has_bias:
        names = (*names, "bias")
    joined = {name: mx.concatenate([p[name] for p in projections], axis=0) for name in names}
    first = projections[0]
    module: Any
    if kind is QuantizedLinear:
        # Built small and given the joined arrays: no random initialisation of the full size.
        module = QuantizedLinear(
            first.group_size,
            1,
            bias=has_bias,
            group_size=first.group_size,
            bits=first.bits,
            mode=first.mode,
        )
    else:
        module = Linear(1, 1, bias=has_bias)
    for name, value in joined.items():
        module[name] = value
    if "biases" in module and "biases" not in joined:  # a mode without biases (e.g. mxfp4)
        del module["biases"]
    return module
