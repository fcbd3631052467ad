"""Compile MLX's CUDA kernels for a quantized model's products at load, not in a request.
Runner thread only (at start-up).

Why (ml-explore/mlx at 846d176, `mlx/backend/cuda/quantized/qmm/qmm_sm80.cu`): the quantized
matrix product of 8 rows or more (`qmm_sm80`) is CUDA source compiled by NVRTC on first use, one
module per row tile (16, 32 or 64 rows: `make_cta_tiler`, the rows' next power of two, clamped)
and per activation dtype, bits, group size and mode. On the H200 host each module took 27-38 s
to compile (`.gpurun` probe, synthetic Llama-3-8B 4-bit: a decode step of 8 rows 26.9 s the first
time then 19 ms; of 17 rows 29.6 s then 26 ms; a 64-token prefill 37.7 s then 25 ms). MLX keeps
the result on disk (`$MLX_PTX_CACHE_DIR`, by default `/tmp/mlx/<version>/ptx`), so a host pays
each module once; but on a fresh host the first requests of a 4-bit model stalled for about a
minute and a half while the batch grew through the three tiles (a 16-request burst took 39 s).

What: `warm_quantized_kernels` runs one product of 16, 32 and 64 rows through one quantized layer
of each distinct (dtype, bits, group size, mode) of the model, below the layer's dequantization
threshold (`quantized_rows`: rows from there on take a dense product, no `qmm`), so that every
module the model's decode steps and prefill chunks can ask for is compiled before the engine
says it is ready. On a host whose cache holds them it costs a few milliseconds.

`warm_few_rows_kernels` does the same for our own kernel of 2 to 8 rows
(`quantized_gemv.quantized_rows_product`, which a batched step of a few rows of a 4-bit model
takes): NVRTC compiles one module per weight shape at its first call (the model's four or five
shapes: fused q/k/v, o, fused gate/up, down, the head), ~1.3 s each on the H100 (the lean step's
row kernels, the same kind of module: 7.7 s of first use against 1.2 s without them). One
product of `FEW_ROWS` rows through one routed layer of each shape compiles them at load, not in
the first request that shares a batch with another.

Where: MLX's CUDA backend (`needed()`); elsewhere the kernels are compiled ahead of time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import mlx.core as mx
from mlx.nn import QuantizedEmbedding, QuantizedLinear  # type: ignore[attr-defined]

from trio_mlx.engine.quantized_rows import RowRoutedEmbedding, RowRoutedLinear, few_rows_product

log = logging.getLogger(__name__)

#: One row count per row tile of `qmm_sm80` (16, 32, 64).
TILE_ROWS = (16, 32, 64)

#: The rows of the product that compiles our few-rows kernel for a weight shape (any count from
#: 2 to `quantized_gemv.MAX_ROWS` takes the same module).
FEW_ROWS = 2


def needed() -> bool:
    """Whether quantized products compile on first use here: MLX's CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def warm_quantized_kernels(model: Any, *, force: bool = False) -> int:
    """Run `TILE_ROWS` products through one quantized layer per distinct kind in `model` (see the
    module docstring) where `needed()` or `force`; return how many products ran (0: none needed
    or no quantized layer). A product MLX refuses is logged and skipped with the rest of its
    kind: the requests that need it will say so themselves."""
    if not (force or needed()):
        return 0
    began = time.perf_counter()
    kinds = ran = 0
    for kind, module in _one_per(model, (QuantizedLinear, QuantizedEmbedding), _kind):
        kinds += 1
        limit = getattr(module, "dequantize_from_rows", None)
        product = module.as_linear if isinstance(module, QuantizedEmbedding) else module
        for rows in TILE_ROWS:
            if limit is not None and rows >= limit:
                continue
            try:
                mx.eval(product(_zero_rows(module, rows)))
            except Exception as exc:  # a warm-up must not stop a model that may serve
                log.warning("quantized kernels of %s not warmed up: %s", kind, exc)
                break
            ran += 1
    if ran:
        log.info(
            "quantized kernels ready in %.1f s (%d kinds; compiled once per host, then cached)",
            time.perf_counter() - began,
            kinds,
        )
    return ran


def warm_few_rows_kernels(model: Any) -> int:
    """Run one product of `FEW_ROWS` rows through one routed quantized layer (`quantized_rows`)
    per distinct weight shape of `model` where our few-rows kernel applies (`few_rows_product`:
    MLX's CUDA backend, affine 4-bit, `TRIO_MLX_FEW_ROWS` not off), so that its modules compile
    at load; return how many products ran (0 where it applies to no layer, as on the CPU). A
    product that fails is logged and skipped: the requests that need it fall back or say so."""
    began = time.perf_counter()
    ran = 0
    for shape, module in _one_per(model, (RowRoutedLinear, RowRoutedEmbedding), _weight_shape):
        product = few_rows_product(module)
        if product is None:
            continue
        try:
            mx.eval(product(_zero_rows(module, FEW_ROWS)))
        except Exception as exc:  # a warm-up must not stop a model that may serve
            log.warning("few-rows kernel of %s not warmed up: %s", shape, exc)
            continue
        ran += 1
    if ran:
        log.info(
            "few-rows kernels ready in %.1f s (%d weight shapes)", time.perf_counter() - began, ran
        )
    return ran


def _one_per(
    model: Any, types: tuple[type, ...], key: Callable[[Any], Hashable]
) -> Iterator[tuple[Hashable, Any]]:
    """(key, module) for the first module of `types` in `model` with each distinct `key`."""
    seen: set[Hashable] = set()
    for _, module in model.named_modules():
        if isinstance(module, types) and (found := key(module)) not in seen:
            seen.add(found)
            yield found, module


def _kind(module: Any) -> Hashable:
    """What `qmm_sm80`'s modules are compiled for: dtype, bits, group size, mode."""
    return (
        module["scales"].dtype,
        module.bits,
        module.group_size,
        getattr(module, "mode", "affine"),
    )


def _weight_shape(module: Any) -> Hashable:
    """What our few-rows kernel is compiled for: the weight's shape, group size and dtype."""
    return (tuple(module["weight"].shape), module.group_size, module["scales"].dtype)


def _zero_rows(module: Any, rows: int) -> Any:
    """`rows` rows of zeros of a quantized layer's input width, in its scales' dtype."""
    width = int(module["weight"].shape[-1]) * 32 // int(module.bits)
    return mx.zeros((rows, width), dtype=module["scales"].dtype)
