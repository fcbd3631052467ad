"""The fast path on MLX's CPU backend: float32 weights through OpenBLAS. Runner thread only.

Measured on a 2-core x86-64 machine (see docs/benchmarks/), MLX's CPU backend multiplies
matrices at ~1.3 GFLOP/s in float32 with the reference BLAS, ~2-4 GFLOP/s in float16/bfloat16
(its own loops, no BLAS) and in its 4-bit kernels, and ~85 GFLOP/s in float32 through OpenBLAS.
So where OpenBLAS serves MLX (`cpu_blas.use_openblas`), a quantized or half-precision model is
turned into float32 at load (`mlx_lm.utils.dequantize_model`, then a cast), as long as the
float32 weights take at most a quarter of the machine's memory. Elsewhere the model stays as
stored: without OpenBLAS, float32 is no faster than the quantized kernels.

`TRIO_MLX_CPU_WEIGHTS`: `auto` (the default, as above), `float32` (always, whatever the size),
or `as-stored` (never). On a GPU nothing here changes anything.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from trio_mlx.engine.cpu_blas import BlasState, use_openblas

log = logging.getLogger(__name__)

_ENV = "TRIO_MLX_CPU_WEIGHTS"
CHOICES = ("auto", "float32", "as-stored")
#: Float32 weights may take at most this share of physical memory under `auto`.
MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class CpuPath:
    """What the CPU backend runs with: the BLAS, and the weights' dtype before and after."""

    blas: BlasState
    stored: str
    running: str
    float32_bytes: int
    reason: str

    def log_line(self) -> str:
        """The one start-up line: what is in use and, where it is not the fast path, what is."""
        weights = (
            f"weights {self.running} (stored as {self.stored})"
            if self.running != self.stored
            else f"weights {self.running}"
        )
        line = f"CPU backend: {weights}; matrix products by {self.blas.describe()}"
        if self.reason:
            line += f"; {self.reason}"
        return line


def on_cpu_backend() -> bool:
    """Whether MLX computes on the CPU here (no Metal or CUDA device by default)."""
    import mlx.core as mx

    return bool(mx.default_device().type == mx.DeviceType.cpu)


def weights_choice() -> str:
    """`TRIO_MLX_CPU_WEIGHTS`, checked (an unknown value is taken as `auto`, with a warning)."""
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        log.warning("%s=%s is not one of %s; using auto", _ENV, value, ", ".join(CHOICES))
        return "auto"
    return value


def prepare_cpu_model(model: Any) -> tuple[Any, CpuPath | None]:
    """On the CPU backend, arrange the BLAS and the weights' dtype; return the model to run.

    Returns `(model, None)` unchanged on a GPU.
    """
    if not on_cpu_backend():
        return model, None
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    blas = use_openblas()
    stored = _stored_dtype(model)
    float32_bytes = 4 * _parameter_count(model)
    choice = weights_choice()
    convert = stored != "float32"
    reason = ""
    if choice == "as-stored":
        convert = False
        if stored != "float32" and blas.optimized:
            reason = f"float32 would be faster ({_ENV}=as-stored keeps them)"
    elif choice == "auto" and convert:
        if not blas.optimized:
            convert = False
            reason = "float32 through OpenBLAS would be ~20x faster at prefill"
        elif float32_bytes > MEMORY_SHARE * _physical_memory():
            convert = False
            reason = (
                f"float32 would be faster but needs {float32_bytes / 2**30:.1f} GiB "
                f"(over a quarter of memory; {_ENV}=float32 forces it)"
            )
    if convert:
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    path = CpuPath(
        blas=blas,
        stored=stored,
        running="float32" if convert else stored,
        float32_bytes=float32_bytes,
        reason=reason,
    )
    return model, path


def _stored_dtype(model: Any) -> str:
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if isinstance(bits, int) and "scales" in module:  # QuantizedLinear, -Embedding, ...
            return f"{bits}-bit"
    dtypes = {str(p.dtype).rsplit(".", 1)[-1] for p in _leaves(model)}
    for name in ("bfloat16", "float16", "float32"):
        if name in dtypes:
            return name
    return "float32"


def _parameter_count(model: Any) -> int:
    """Weights as dense elements (a quantized matrix counted at its unpacked size)."""
    total = 0
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if isinstance(bits, int) and "scales" in module:
            weight = module["weight"]
            total += weight.size * 32 // bits - weight.size
            total -= module["scales"].size
            if "biases" in module:
                total -= module["biases"].size
    total += sum(int(p.size) for p in _leaves(model))
    return total


def _leaves(model: Any) -> list[Any]:
    from mlx.utils import tree_flatten

    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return [p for _, p in flat]


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30
