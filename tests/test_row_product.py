"""Our one-row kernels with a block's norms, SwiGLU and residual adds taken in
(`engine/row_product.py`) apply only on MLX's CUDA backend; there each form, for bf16/fp16 and
4-bit weights, is at least as close to the float32 arithmetic as the model's own nodes (within a
margin for the norm's differently ordered sum), a row the kernel does not take goes through the
model's modules, and the lean step through them keeps the model's logits within rounding.

The kernels are CUDA code: the tests that run them need MLX's CUDA backend and skip elsewhere (CI
has no GPU); they run on the GPU host (`python -m pytest tests/test_row_product.py`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.activations import swiglu

from kernel_checks import dequantized_copy, logit_errors, relative_errors
from tiny_model import build_in_memory
from trio_mlx.engine.fused import fuse_projections
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.engine.quantized_gemv import available
from trio_mlx.engine.row_product import row_product

on_cuda = pytest.mark.skipif(
    not available(), reason="needs MLX's CUDA backend: the kernels are CUDA code; no CUDA GPU here"
)


def _layer(width: int, columns: int, dtype: Any, quantized: bool) -> Any:
    mx.random.seed(width + columns)
    layer = nn.Linear(width, columns, bias=False)
    layer.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4) if quantized else layer


def _weight32(layer: Any) -> Any:
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(
            layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=4
        ).astype(mx.float32)
    return layer.weight.astype(mx.float32)


def _norm(width: int, dtype: Any) -> Any:
    norm = nn.RMSNorm(width, eps=1e-5)
    norm.weight = (1.0 + 0.1 * mx.random.normal((width,))).astype(dtype)
    return norm


def test_the_kernels_apply_only_on_a_cuda_gpu() -> None:
    """On MLX's CUDA backend a product; elsewhere (this CPU, Metal) None, and the lean step
    keeps its own nodes for every block."""
    assert (row_product(_layer(128, 64, mx.bfloat16, False), residual=True) is not None) == (
        available()
    )
    model = build_in_memory("llama", tied=False)
    model.set_dtype(mx.bfloat16)  # the kernels take bf16/fp16 or 4-bit weights, never float32
    fuse_projections(model)
    lean = LeanStep(model, row_kernels=True)
    assert lean.kernel_layers == (len(model.model.layers) if available() else 0)


def test_a_biased_or_eight_bit_layer_never_takes_them() -> None:
    assert row_product(nn.Linear(128, 64, bias=True)) is None
    eight = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), group_size=64, bits=8)
    assert row_product(eight) is None


@on_cuda
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize(
    ("stage", "residual", "width", "columns", "dtype"),
    [
        ("plain", False, 4096, 6144, mx.bfloat16),
        ("norm", False, 2048, 3072, mx.bfloat16),
        ("norm", False, 4096, 1153 * 2, mx.float16),
        ("plain", True, 4096, 4096, mx.bfloat16),
        ("swiglu", True, 14336, 4096, mx.bfloat16),
        ("swiglu", False, 1152, 896, mx.bfloat16),  # not a multiple of 1,024: a partial last step
        ("norm", False, 2048, 32000, mx.bfloat16),  # a head
    ],
)
def test_each_form_is_as_close_as_the_models_own_nodes(
    quantized: bool, stage: str, residual: bool, width: int, columns: int, dtype: Any
) -> None:
    layer = _layer(width, columns, dtype, quantized)
    norm = _norm(width, dtype) if stage == "norm" else None
    product = row_product(layer, norm=norm, swiglu=stage == "swiglu", residual=residual)
    assert product is not None
    row = 2 * width if stage == "swiglu" else width
    x = mx.random.normal((1, row)).astype(dtype)
    r = mx.random.normal((1, columns)).astype(dtype) if residual else None
    # the model's own nodes, in its dtype
    if norm is not None:
        inputs = norm(x)
    elif stage == "swiglu":
        inputs = swiglu(*mx.split(x, 2, axis=-1))
    else:
        inputs = x
    own = layer(inputs) if r is None else r + layer(inputs)
    # the same arithmetic in float32 from the model's rounded input row
    exact = inputs.astype(mx.float32) @ _weight32(layer).T
    if r is not None:
        exact = exact + r.astype(mx.float32)
    ours = product(x, r)
    assert ours.shape == own.shape == (1, columns) and ours.dtype == dtype
    ours_error, own_error = relative_errors(exact, ours, own)
    # the norm's sum of squares, summed in another order, may round an input element apart
    margin = 2e-2 if norm is not None else 1e-2
    assert ours_error <= max(own_error, margin)


@on_cuda
def test_a_row_the_kernel_does_not_take_goes_through_the_models_modules() -> None:
    layer = _layer(256, 128, mx.bfloat16, False)
    norm = _norm(256, mx.bfloat16)
    product = row_product(layer, norm=norm)
    assert product is not None
    rows = mx.random.normal((3, 256)).astype(mx.bfloat16)  # three rows
    assert mx.array_equal(product(rows), layer(norm(rows))).item()
    row32 = mx.random.normal((1, 256))  # float32
    assert mx.array_equal(product(row32), layer(norm(row32))).item()


@on_cuda
@pytest.mark.parametrize(("quantized", "tied"), [(False, True), (False, False), (True, False)])
def test_the_lean_step_through_them_keeps_the_models_logits(quantized: bool, tied: bool) -> None:
    """40 steps: the lean step with every block and the head through the kernels, and the model's
    own step, each against the model in float32 (4-bit weights dequantized)."""
    model = build_in_memory("llama", tied=tied)
    if quantized:
        nn.quantize(model, group_size=64, bits=4)
    exact = dequantized_copy(model, tied=tied) if quantized else build_in_memory("llama", tied=tied)
    model.set_dtype(mx.bfloat16)
    fuse_projections(model)
    lean = LeanStep(model, row_kernels=True)
    assert lean.kernel_layers == len(model.model.layers)
    own_error, ours_error = logit_errors(exact, model, lean)
    assert ours_error <= 1.2 * own_error
