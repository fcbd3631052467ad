"""Our one-row 4-bit kernel (`engine/quantized_gemv.py`) applies only on MLX's CUDA backend to
affine 4-bit layers; there its product is at least as close to the float32 product of the
dequantized weight as MLX's own kernel's, across group sizes, dtypes, widths that are and are
not a multiple of its step, odd column counts and a layer's bias, and the lean step through it
keeps the model's logits within rounding.

The kernel is CUDA code: the tests that run it need MLX's CUDA backend and skip elsewhere (CI has
no GPU); they run on the GPU host (`python -m pytest tests/test_quantized_gemv.py`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from kernel_checks import dequantized_copy, logit_errors, relative_errors
from tiny_model import build_in_memory
from trio_mlx.engine import quantized_gemv as qg
from trio_mlx.engine.lean_step import LeanStep

on_cuda = pytest.mark.skipif(
    not qg.available(),
    reason="needs MLX's CUDA backend: the kernel is CUDA code; no CUDA GPU here",
)


def _layer(width: int, columns: int, group: int, dtype: Any, *, bias: bool = False) -> Any:
    mx.random.seed(width + columns + group)
    layer = nn.Linear(width, columns, bias=bias)
    layer.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=group, bits=4)


def _exact(layer: Any, x: Any) -> Any:
    """The float32 product of the dequantized weight (and the layer's bias)."""
    weight = mx.dequantize(
        layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=4
    ).astype(mx.float32)
    y = x.astype(mx.float32) @ weight.T
    return y + layer.bias.astype(mx.float32) if "bias" in layer else y


def test_a_four_bit_layer_takes_the_kernel_only_on_a_cuda_gpu() -> None:
    """On MLX's CUDA backend a product; elsewhere (this CPU, Metal) nothing is replaced: the lean
    step calls the module as is."""
    product = qg.quantized_gemv(_layer(128, 64, 64, mx.bfloat16))
    assert (product is not None) == qg.available()


def test_only_affine_four_bit_layers_take_it() -> None:
    """An 8-bit layer, or a plain one, never takes the kernel, on any backend."""
    eight = nn.QuantizedLinear.from_linear(nn.Linear(128, 64), group_size=64, bits=8)
    assert qg.quantized_gemv(eight) is None


@on_cuda
@pytest.mark.parametrize(
    ("width", "columns", "group", "dtype", "bias"),
    [
        (4096, 6144, 64, mx.bfloat16, False),
        (14336, 4096, 64, mx.bfloat16, False),
        (4096, 1024, 32, mx.bfloat16, False),
        (2048, 512, 128, mx.float16, False),
        (18944, 256, 64, mx.bfloat16, False),  # not a multiple of 1,024: a partial last step
        (896, 1153, 64, mx.bfloat16, True),  # odd columns (one a warp), qwen2's biased layers
    ],
)
def test_the_product_is_as_close_as_mlxs(
    width: int, columns: int, group: int, dtype: Any, bias: bool
) -> None:
    layer = _layer(width, columns, group, dtype, bias=bias)
    product = qg.quantized_gemv(layer)
    assert product is not None
    x = mx.random.normal((1, width)).astype(dtype)
    exact = _exact(layer, x)
    ours, theirs = product(x), layer(x)
    assert ours.shape == theirs.shape == (1, columns) and ours.dtype == dtype
    ours_error, theirs_error = relative_errors(exact, ours, theirs)
    assert ours_error <= max(theirs_error, 1e-2)


@on_cuda
def test_a_row_of_another_dtype_takes_the_layers_own_product() -> None:
    layer = _layer(256, 128, 64, mx.bfloat16)
    product = qg.quantized_gemv(layer)
    assert product is not None
    x = mx.random.normal((1, 256))  # float32
    assert mx.array_equal(product(x), layer(x)).item()


@on_cuda
def test_the_lean_step_through_it_is_as_close_to_the_exact_logits_as_the_models_own() -> None:
    """40 steps of a 4-bit bf16 model: the lean step (our kernel for every projection) and the
    model's own step (MLX's), each against the float32 model of the dequantized weights."""
    model = build_in_memory("llama", tied=False)
    nn.quantize(model, group_size=64, bits=4)
    model.set_dtype(mx.bfloat16)
    exact = dequantized_copy(model)
    lean = LeanStep(model)
    assert lean._layers[0].down is not model.model.layers[0].mlp.down_proj  # the kernel's
    own_error, ours_error = logit_errors(exact, model, lean)
    assert ours_error <= 1.2 * own_error


@on_cuda
@pytest.mark.parametrize("rows", [2, 5, 8])
@pytest.mark.parametrize(
    ("width", "columns", "group", "dtype", "bias"),
    [
        (4096, 6144, 64, mx.bfloat16, False),
        (14336, 4096, 64, mx.bfloat16, False),
        (2048, 512, 128, mx.float16, False),
        (18944, 256, 32, mx.bfloat16, False),  # a partial last step
        (896, 1153, 64, mx.bfloat16, True),  # odd columns, a bias
    ],
)
def test_a_few_rows_are_as_close_as_mlxs(
    rows: int, width: int, columns: int, group: int, dtype: Any, bias: bool
) -> None:
    """2 to 8 rows in one pass over the weight: each row as close to the float32 product as
    MLX's kernel makes it."""
    layer = _layer(width, columns, group, dtype, bias=bias)
    product = qg.quantized_rows_product(layer)
    assert product is not None
    x = mx.random.normal((rows, width)).astype(dtype)
    exact = _exact(layer, x)
    ours, theirs = product(x), layer(x)
    assert ours is not None and ours.shape == theirs.shape == (rows, columns)
    ours_error, theirs_error = relative_errors(exact, ours, theirs)
    assert ours_error <= max(theirs_error, 1e-2)


@on_cuda
def test_other_row_counts_are_left_to_the_caller() -> None:
    layer = _layer(256, 128, 64, mx.bfloat16)
    product = qg.quantized_rows_product(layer)
    assert product is not None
    for rows in (1, qg.MAX_ROWS + 1):
        assert product(mx.random.normal((rows, 256)).astype(mx.bfloat16)) is None
    assert product(mx.random.normal((4, 256))) is None  # float32 rows


@on_cuda
def test_a_routed_layer_takes_a_few_rows_through_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batched decode step's (B, 1, K) input to a routed layer (`quantized_rows`, as served on
    MLX's CUDA backend) gets the kernel's product for B = 2 to 8, MLX's beyond."""
    from trio_mlx.engine import quantized_rows
    from trio_mlx.engine.quantized_rows import route_rows

    monkeypatch.setattr(quantized_rows, "FEW_ROWS_KERNEL", True)
    model = nn.Sequential(_layer(512, 256, 64, mx.bfloat16))
    route_rows(model, 128)
    layer = model.layers[0]
    product = qg.quantized_rows_product(layer)
    assert product is not None
    x = mx.random.normal((4, 1, 512)).astype(mx.bfloat16)
    assert mx.array_equal(layer(x), product(x.reshape(4, 512)).reshape(4, 1, 256)).item()
    wide = mx.random.normal((12, 1, 512)).astype(mx.bfloat16)
    own = nn.QuantizedLinear.__call__(layer, wide.reshape(12, 512)).reshape(12, 1, 256)
    assert mx.array_equal(layer(wide), own).item()


@on_cuda
def test_the_few_rows_kernels_compile_at_load_once_a_weight_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kernel_warmup.warm_few_rows_kernels` runs one product per distinct weight shape of the
    routed 4-bit layers (three layers, two shapes: two products), none for an 8-bit layer, and
    afterwards each layer's few rows still give the kernel's product."""
    from trio_mlx.engine import quantized_rows
    from trio_mlx.engine.kernel_warmup import warm_few_rows_kernels
    from trio_mlx.engine.quantized_rows import route_rows

    monkeypatch.setattr(quantized_rows, "FEW_ROWS_KERNEL", True)
    eight = nn.QuantizedLinear.from_linear(nn.Linear(256, 256, bias=False), group_size=64, bits=8)
    model = nn.Sequential(
        _layer(512, 256, 64, mx.bfloat16),
        _layer(512, 256, 64, mx.bfloat16),
        _layer(256, 512, 64, mx.bfloat16),
        eight,
    )
    route_rows(model, 128)
    assert warm_few_rows_kernels(model) == 2
    for layer in model.layers[:3]:
        x = mx.random.normal((3, layer.weight.shape[1] * 8)).astype(mx.bfloat16)
        product = qg.quantized_rows_product(layer)
        assert product is not None
        assert mx.array_equal(layer(x), product(x)).item()
    monkeypatch.setattr(quantized_rows, "FEW_ROWS_KERNEL", False)  # TRIO_MLX_FEW_ROWS=off
    assert warm_few_rows_kernels(model) == 0
