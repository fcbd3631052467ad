"""Quantized layers that multiply many rows by their weight dequantized. Runner thread only.

Why (MLX 0.32's CUDA backend, read in ml-explore/mlx `mlx/backend/cuda/quantized/` at 846d176,
just after 0.32.2; the 0.32.4 CUDA wheel carries the same `qmm_sm80` and `qmm_sm90` kernels):
`QuantizedMatmul::eval_gpu` (`quantized.cpp`) takes M = the input's second-to-last dimension
and treats every dimension before it as a batch of separate matrices. On an H200 (compute
capability 9) an affine 4-bit model of group size 64 gets
- `qmv` (`qmm/qmv.cu`) while M x batch < 8: one warp per output column *and input row*, each
  reading and dequantizing that weight row itself, so the cost grows with every row;
- `qmm_sm80` (`qmm/qmm_sm80.cu`) from 8 rows: CUTLASS/cute tiles on Ampere-style tensor-core
  instructions (no Hopper wgmma), tile M = 16-64, one grid slice per batch matrix, and every
  tile dequantizes its whole 128-column slice of the weight again. mlx-lm's batched decode feeds
  hidden states of shape (B, 1, K): M = 1 and B batch matrices, so B slices each compute one
  useful row of a 16-row tile and dequantize the whole weight B times (linear in B, as measured:
  205.8 ms a step at B = 64 against 10.5 ms in bf16). A 2,048-token prompt is M = 2,048: the
  weight is dequantized again for each of its 32 tiles (3.3x the bf16 prefill);
- `qmm_sm90` (`qmm/qmm_sm90.cu`, wgmma) only where `supports_qmm_sm90` (`qmm/qmm.cu`) holds,
  which requires `group_size >= K`: one scale per weight row, never a group-size-64 model.
So nothing in the quantized kernels shares a dequantized weight between more than one 64-row
tile, while a dense product (cuBLAS) reads the weight once for all rows.

What: `route_rows(model, threshold)` makes every `mlx.nn.QuantizedLinear` of `model` (and the
output head of a `QuantizedEmbedding` tied to it, `as_linear`) compute an input of M >=
`threshold` rows (M = the product of the input's leading dimensions, known when the graph is
built) as `mx.dequantize` of its weight in the input's dtype followed by a dense matrix product;
fewer rows take the usual `mx.quantized_matmul` with the input's rows folded into one matrix
(`flat`: a batched decode step's (B, 1, K) becomes (B, K), one `qmm_sm80` tile of up to 64 rows
where MLX ran B slices).

Measured on the H200 (`python -m bench.quantized_rows`, synthetic Llama-3-8B 4-bit, g64; ms a
decode step at B = 1 / 4 / 8 / 16 / 64 / 128, then a 2,048-token prefill pass): MLX's kernel as
mlx-lm calls it 10.0 / 24.0 / 35.2 / 61.9 / 213.8 / 414.5, 245 ms; folded 10.8 / 22.9 / 21.5 /
23.2 / 40.2 / 51.0; dequantized 25.8 / 25.8 / 28.2 / 27.9 / 40.8 / 48.1, 64.5 ms. So: folded
below `CUDA_DEQUANTIZE_FROM_ROWS` rows (a step of 64 rows 5.3x faster than before), dequantized
from there (a 2,048-token prefill 3.8x faster). A dequantized weight is a
temporary of the graph, computed once the layer's input is and freed once its product is, so
about one layer's weights are dense at a time (on the CPU: a 6.5 MB peak for a model whose
layers dequantize to 32 MB, 4.2 MB a layer); the model keeps no second copy.

The layers are changed in place (their class, not their arrays), so references to them held
elsewhere see the routing too: the fused q/k/v and gate/up layers that `fused.fuse_projections`
made (route after fusing: fusion only joins plain `QuantizedLinear`s), and the steps that
`compiled_step` traces (one trace per input shape, so each trace holds the branch for its own
row count; route before tracing).

Numerics: the dense product sums in another order than the quantized kernels (on the CPU backend
in float32 the outputs agree to float rounding; on a GPU in bf16 the two may round differently).

When: `default_threshold()`: `CUDA_DEQUANTIZE_FROM_ROWS` on MLX's CUDA backend; off on Metal (not
measured there: its quantized kernels are others) and on the CPU, where `cpu_path` already runs
a quantized model as float32 weights through OpenBLAS (then nothing here is quantized) or keeps
the quantized kernels for a reason of its own.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.nn import QuantizedEmbedding, QuantizedLinear  # type: ignore[attr-defined]

from trio_mlx.engine.quantized_gemv import quantized_rows_product

__all__ = [
    "CUDA_DEQUANTIZE_FROM_ROWS",
    "RowRoutedEmbedding",
    "RowRoutedLinear",
    "apply_threshold",
    "default_threshold",
    "few_rows_product",
    "flat",
    "resolve_threshold",
    "route_rows",
    "rows_of",
    "unroute_rows",
]

log = logging.getLogger(__name__)

#: Rows from which a quantized layer dequantizes its weight on MLX's CUDA backend: where the
#: dequantized product overtook the folded quantized kernel on the H200 (B = 64: 40.8 / 40.2
#: ms, B = 128: 48.1 / 51.0 ms; module docstring).
CUDA_DEQUANTIZE_FROM_ROWS = 128

#: The attribute holding a routed layer's threshold (a plain attribute, not a parameter).
_THRESHOLD = "dequantize_from_rows"

#: Whether 2 to `quantized_gemv.MAX_ROWS` rows take our kernel (`_few_rows`) where it applies
#: (MLX's CUDA backend, affine 4-bit): on unless `TRIO_MLX_FEW_ROWS=off`. Measured on an H100
#: (`bench.quantized_rows`, synthetic 8B 4-bit, ms a batched step): 2 rows 10.9 against MLX's
#: 13.6, 4 rows 15.9 against 22.0, 8 rows 21.2 against 21.0 folded (MLX's tiled kernel, even).
FEW_ROWS_KERNEL = os.environ.get("TRIO_MLX_FEW_ROWS", "on").lower() != "off"

#: The attribute holding a routed layer's few-rows kernel (`quantized_rows_product`), made at its
#: first product of 2 to `quantized_gemv.MAX_ROWS` rows; False where the kernel does not apply.
_FEW_ROWS = "_few_rows_product"


def few_rows_product(layer: Any) -> Callable[[Any], Any] | None:
    """`layer`'s product through our kernel that reads the weight once for all rows (made at the
    first call, then kept on the layer), or None where it does not apply (`TRIO_MLX_FEW_ROWS=off`,
    not MLX's CUDA backend, another quantization). The product itself returns None for a row
    count outside 2 to `quantized_gemv.MAX_ROWS` or another dtype than the scales'."""
    if not FEW_ROWS_KERNEL:
        return None
    product = layer.__dict__.get(_FEW_ROWS)
    if product is None:
        product = quantized_rows_product(layer) or False
        object.__setattr__(layer, _FEW_ROWS, product)
    return product or None


def _few_rows(layer: Any, x: Any) -> Any:
    """`layer`'s product of `x` (rows as one matrix) through `few_rows_product`, or None where
    it does not apply."""
    product = few_rows_product(layer)
    return None if product is None else product(x)


def _quantized(layer: Any, x: Any, own: Any) -> Any:
    """`x` (any leading dims) times `layer`'s quantized weight as one matrix (`flat`): through
    `_few_rows` where it applies, else `own` (MLX's kernel)."""

    def product(rows: Any) -> Any:
        y = _few_rows(layer, rows)
        return own(rows) if y is None else y

    return flat(x, product)


def rows_of(x: Any) -> int:
    """The rows `x` (shape (..., K)) is to a matrix product: the product of its leading dims."""
    return math.prod(x.shape[:-1])


def flat(x: Any, product: Any) -> Any:
    """`product(x)` with `x`'s leading dimensions folded into one (M rows of one matrix, not M
    matrices of one row: see the module docstring), unfolded again after. The same values."""
    if x.ndim <= 2:
        return product(x)
    out = product(x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _dequantized(layer: Any, x: Any) -> Any:
    """`layer`'s weight as a dense (output, input) matrix of `x`'s dtype: a temporary of the
    graph, computed once `x` is (`mx.depends`: MLX would otherwise schedule a dequantization,
    which needs nothing but the weights, layers ahead of its product, holding many at once)."""
    packed = mx.depends(layer["weight"], x)
    return mx.dequantize(
        packed,
        scales=layer["scales"],
        biases=layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
        dtype=x.dtype,
    )


class RowRoutedLinear(QuantizedLinear):  # type: ignore[misc]
    """A `QuantizedLinear` that computes an input of at least `dequantize_from_rows` rows through
    its dequantized weight (`dense`), fewer rows by the quantized kernel (`quantized`). Made by
    `route_rows` from a `QuantizedLinear` in place; never constructed."""

    dequantize_from_rows: int

    def __call__(self, x: Any) -> Any:
        if rows_of(x) >= self.dequantize_from_rows:
            return self.dense(x)
        return self.quantized(x)

    def quantized(self, x: Any) -> Any:
        """`QuantizedLinear`'s product of `x`'s rows as one matrix (`_quantized`)."""
        return _quantized(self, x, super().__call__)

    def dense(self, x: Any) -> Any:
        """`x` times the weight dequantized to `x`'s dtype, plus the bias if any."""
        weight = _dequantized(self, x)
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight.T)
        return x @ weight.T


class RowRoutedEmbedding(QuantizedEmbedding):  # type: ignore[misc]
    """A `QuantizedEmbedding` whose output-head use (`as_linear`, a tied head) is routed by rows
    as `RowRoutedLinear`'s product is; looking tokens up is unchanged. Made by `route_rows`."""

    dequantize_from_rows: int

    def as_linear(self, x: Any) -> Any:
        if rows_of(x) >= self.dequantize_from_rows:
            return self.dense(x)
        return self.quantized(x)

    def quantized(self, x: Any) -> Any:
        """`QuantizedEmbedding.as_linear`'s product of `x`'s rows as one matrix (`_quantized`)."""
        return _quantized(self, x, super().as_linear)

    def dense(self, x: Any) -> Any:
        """`x` times the embedding matrix, dequantized to `x`'s dtype, transposed."""
        return x @ _dequantized(self, x).T


_ROUTED = {QuantizedLinear: RowRoutedLinear, QuantizedEmbedding: RowRoutedEmbedding}
_PLAIN = {routed: plain for plain, routed in _ROUTED.items()}


def route_rows(model: Any, threshold: int) -> int:
    """Route every `QuantizedLinear` and `QuantizedEmbedding` of `model` by rows from `threshold`
    on (see the module docstring); a layer already routed takes the new threshold. Subclasses
    and other quantized layer types are left alone. Returns how many layers are routed."""
    if threshold < 1:
        raise ValueError(f"a threshold is at least one row, not {threshold}")
    routed = 0
    for _, module in model.named_modules():
        kind = type(module)
        if kind in _ROUTED:
            module.__class__ = _ROUTED[kind]
        elif kind not in _PLAIN:
            continue
        object.__setattr__(module, _THRESHOLD, threshold)
        routed += 1
    return routed


def unroute_rows(model: Any) -> int:
    """Put every routed layer of `model` back to the plain quantized product; return how many."""
    restored = 0
    for _, module in model.named_modules():
        plain = _PLAIN.get(type(module))
        if plain is None:
            continue
        module.__class__ = plain
        object.__delattr__(module, _THRESHOLD)
        module.__dict__.pop(_FEW_ROWS, None)
        restored += 1
    return restored


def default_threshold() -> int | None:
    """`CUDA_DEQUANTIZE_FROM_ROWS` on MLX's CUDA backend, else None (off): see the module
    docstring."""
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    return CUDA_DEQUANTIZE_FROM_ROWS if on_cuda else None


def resolve_threshold(option: int | None) -> int | None:
    """`EngineConfig.dequantize_from_rows` as a threshold: None is `default_threshold()`, 0 is
    off (None), any other value itself."""
    if option is None:
        return default_threshold()
    return option or None


def apply_threshold(model: Any, option: int | None) -> int:
    """Route `model`'s quantized layers by `resolve_threshold(option)` rows (none when off);
    log and return how many were routed."""
    threshold = resolve_threshold(option)
    if threshold is None:
        return 0
    routed = route_rows(model, threshold)
    if routed:
        log.info(
            "quantized layers dequantize their weight for inputs of %d rows or more (%d layers)",
            threshold,
            routed,
        )
    return routed
