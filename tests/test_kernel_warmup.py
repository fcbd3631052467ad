"""`kernel_warmup.warm_quantized_kernels`: one product per row tile through one quantized layer of
each kind (dtype, bits, group size, mode), none past a layer's dequantization threshold; nothing
where the kernels are compiled ahead of time (here, the CPU) unless forced. `warm_few_rows_kernels`
runs nothing where our few-rows kernel does not apply (here, the CPU; its GPU test is in
tests/test_quantized_gemv.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from trio_mlx.engine.kernel_warmup import TILE_ROWS, warm_few_rows_kernels, warm_quantized_kernels
from trio_mlx.engine.quantized_gemv import available
from trio_mlx.engine.quantized_rows import route_rows


class TwoKinds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = [nn.Linear(128, 64) for _ in range(3)]  # three layers of one kind
        self.b = nn.Linear(64, 64)

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.a:
            x = layer(x)
        return self.b(x)


def quantized() -> TwoKinds:
    model = TwoKinds()
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, _: p.startswith("a"))
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, _: p == "b")
    return model


def test_nothing_runs_where_the_kernels_are_compiled_ahead_of_time() -> None:
    assert warm_quantized_kernels(quantized()) == 0


def test_one_product_per_tile_and_kind_below_the_threshold() -> None:
    model = quantized()
    assert warm_quantized_kernels(model, force=True) == 2 * len(TILE_ROWS)
    route_rows(model, 32)  # 32 rows and more take the dense product: no quantized kernel
    assert warm_quantized_kernels(model, force=True) == 2 * sum(r < 32 for r in TILE_ROWS)
    assert warm_quantized_kernels(nn.Linear(8, 8), force=True) == 0  # nothing quantized


def test_a_product_mlx_refuses_is_skipped_not_fatal() -> None:
    class Refused(nn.QuantizedLinear):  # type: ignore[misc]
        def __call__(self, x: mx.array) -> mx.array:
            raise ValueError("no kernel for this shape here")

    model = quantized()
    model.b.__class__ = Refused  # the 8-bit kind cannot run: the 4-bit one still warms up
    assert warm_quantized_kernels(model, force=True) == len(TILE_ROWS)


def test_no_few_rows_product_where_our_kernel_does_not_apply() -> None:
    """Off MLX's CUDA backend (this CPU) the routed layers keep MLX's products: nothing to warm.
    On it, neither float32 scales (the 4-bit kind here) nor 8 bits take our kernel."""
    model = quantized()
    route_rows(model, 32)
    assert warm_few_rows_kernels(model) == 0
    bf16 = quantized()
    bf16.set_dtype(mx.bfloat16)  # bf16 scales: the 4-bit kind takes it, where MLX runs on CUDA
    route_rows(bf16, 32)
    assert warm_few_rows_kernels(bf16) == (1 if available() else 0)
    assert warm_few_rows_kernels(nn.Linear(8, 8)) == 0  # nothing quantized, nothing routed
