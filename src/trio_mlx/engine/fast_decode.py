"""What `EngineConfig.compiled_decode`, `EngineConfig.fused_projections` and
`EngineConfig.dequantize_from_rows` turn on for a loaded model. Runner thread only.

- fused q/k/v and gate/up projections (`fused.fuse_projections`): two matrix products a layer
  where there were five. `fused_projections` None: on where MLX runs on a GPU, where a decode
  step is bound by launching kernels (H200, `bench.compiled_decode`, batch 1, tok/s over the plain
  step, two runs: 1B bf16 1.14-1.29x at a 128-token prompt and 1.08-1.44x at 1,536; 8B bf16
  1.10x / 1.07x; 8B 4-bit 0.93-1.01x with MLX's quantized kernels, hence off for quantized
  models, except on MLX's CUDA backend, where the lean step's own 4-bit kernel makes the fused
  8B 4-bit step 1.29-1.32x the unfused one: H100, 2026-12-06), off on the CPU, where arithmetic
  sets a step's time.
- the decode step traced once per KV length bucket and replayed (`compiled_step.CompiledDecode`):
  one sequence's on the serialized route; the batch's on the batched route only with
  `TRIO_MLX_COMPILED_BATCH=on` (the batch step is traced once per batch size and bucket, and
  under load the batch size changes with every arrival and departure, each new one a stall of
  one trace for every row; `bench/batch_ceiling.py` measures it at fixed sizes). It implies the
  fused projections. `compiled_decode` None: off. On the H200 its replay dispatches more slowly
  than the plain step is built and dispatched (the same bench: 0.60–0.93x the plain step's
  tok/s, the fused model's traced step 0.71–0.99x the fused model's plain one), so it stays an
  experiment (docs/benchmarks/README.md, "Compiled decode").
- small batches through the traced batch step (`traced_batch_rows`, `prepare_batch_step`): from 2
  to `traced_batch_rows` rows, where the plain batch step is bound by the host building it
  (mlx-lm's batch cache, masks and per-row offsets: on an H100's 1B bf16 the fused plain step
  took 4.3-5.7 ms at 2-8 rows against 2.3 ms for a lone row, the traced one 3.2-3.6 ms, 1.24-1.79x;
  the 8B 0.85-1.35x; at 16 rows the traced step is slower, 0.58-0.69x: its attention runs
  unfused over the whole bucket; `bench/batch_ceiling.py`, docs/benchmarks). Through HTTP on
  the 1B, 2 streams decoded at 1.42x the plain step's aggregate; on the 8B one sample at 2
  streams gave 0.77x and at 4 1.06x. Each (rows, bucket) is traced and run once at load (the
  device compiles its fused kernels on first use: seconds each on CUDA, kept on disk by MLX).
  A lone row keeps its own cache and plain step, and a pass that carries prompt chunks is
  plain. `traced_batch_rows` None: 0 (off) on every backend until measured more widely.
- the lean one-token step (`lean_step.LeanStep`: the model's own arithmetic in ~40% fewer graph
  nodes, the host's cost of a batch-1 step on a GPU): a lone sequence's decode steps on either
  route, where no traced step serves (H100, `bench.compiled_decode`: the engine 1.22-1.23x the
  fused step's tok/s on the 1B bf16 shape, 1.02-1.12x on the 8B bf16, which then waits on the
  device in part; on MLX's CUDA backend its 4-bit products go through our kernel
  (`quantized_gemv`): the 8B 4-bit engine 1.47-1.55x raw mlx-lm, 1.02-1.15x with MLX's
  kernels). `lean_decode` None: on where MLX runs on a GPU, off on the CPU (where arithmetic sets
  a step's time; the logits are the same there, as the tests check). With
  `TRIO_MLX_ROW_KERNELS=on` (experimental: on an H100 the 1B bf16 gained 4% after a short
  prompt and lost 17% after a long one, so off by default) its blocks' products take
  in their norms, SwiGLU and residual adds (`row_product`: our kernels, CUDA only); a warm-up
  step that fails with them falls back to the lean step without them.
- quantized layers that multiply an input of many rows by their dequantized weight
  (`quantized_rows.route_rows`; `dequantize_from_rows` None: on MLX's CUDA backend only).

The order matters: projections are fused first (fusion joins plain quantized layers only), then
the quantized layers routed by rows (the fused ones included), then the step traced (a trace keeps
the branch its rows took).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from trio_mlx.engine import quantized_gemv
from trio_mlx.engine.compiled_step import CompiledDecode, unsupported_reason
from trio_mlx.engine.fused import fuse_projections
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.engine.quantized_rows import apply_threshold

log = logging.getLogger(__name__)


#: Environment switch of the traced batch step (`on` / anything else: off).
COMPILED_BATCH_ENV = "TRIO_MLX_COMPILED_BATCH"


def compiled_batch_enabled() -> bool:
    """Whether the batched route uses the traced batch step (see the module docstring)."""
    return os.environ.get(COMPILED_BATCH_ENV, "").strip().lower() == "on"


def default_compiled_decode() -> bool:
    """Off on every backend: slower than the plain step where it was measured (module docstring)."""
    return False


#: `traced_batch_rows` when none is given: 0 (off) on every backend, measured faster on the 1B
#: bf16 shape only, with a start-up cost (module docstring); `--traced-batch-rows 8` turns it on.
DEFAULT_TRACED_BATCH_ROWS = 0


def prepare_batch_step(model: Any, rows: int, *, reuse: CompiledDecode | None = None) -> Any:
    """The traced batch step for batches of 2 to `rows` rows, every (rows, bucket) up to 4,096
    positions traced now; None where `rows` < 2, the model cannot take it or tracing fails
    (logged; the plain step serves). `reuse`: the model's traced decode step, if any."""
    if rows < 2:
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("traced batch step off: %s", reason)
        return None
    decoder = reuse if reuse is not None else CompiledDecode(model)
    began = time.perf_counter()
    try:
        if not decoder.warm_up_batch(range(2, rows + 1)):
            log.info("traced batch step off: the model's cache cannot take it")
            return None
    except Exception:  # the traced step cannot run here: serve the plain one
        log.exception("traced batch step off: tracing it failed")
        return None
    log.info(
        "batches of 2 to %d rows decode through a traced step (traced in %.2f s)",
        rows,
        time.perf_counter() - began,
    )
    return decoder


def default_lean_decode() -> bool:
    """On where MLX runs on a GPU, where a batch-1 step is bound by the host (module docstring)."""
    return bool(mx.default_device() == mx.gpu)


def prepare_lean_step(model: Any, enabled: bool | None) -> LeanStep | None:
    """The model's lean one-token step (`lean_step`), built after its projections are fused and
    run once over a fresh cache (kernels compiled at load), or None where it is off (`enabled`
    None: `default_lean_decode`), the model is not one it knows or that step fails (logged)."""
    if not (default_lean_decode() if enabled is None else enabled):
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("lean decode step off: %s", reason)
        return None
    row_kernels = os.environ.get("TRIO_MLX_ROW_KERNELS", "").lower() == "on"
    began = time.perf_counter()
    lean = _warmed_up(model, row_kernels)
    if lean is None and row_kernels:
        lean = _warmed_up(model, False)
    if lean is None:
        return None
    log.info(
        "lone sequences decode through the lean one-token step (%d of %d blocks through our "
        "row kernels; warmed up in %.2f s)",
        lean.kernel_layers,
        len(model.model.layers),
        time.perf_counter() - began,
    )
    return lean


def _warmed_up(model: Any, row_kernels: bool) -> LeanStep | None:
    """The lean step, run once over a fresh cache (the device compiles kernels on first use, ours
    by NVRTC: at load, not in a request), or None where that step fails (logged)."""
    lean = LeanStep(model, row_kernels=row_kernels)
    try:
        mx.eval(lean.step(mx.array([0], dtype=mx.uint32), make_prompt_cache(model), greedy=True))
    except Exception:  # the lean step cannot run here (with these kernels)
        log.exception("lean decode step (row kernels %s) off: its warm-up step failed", row_kernels)
        return None
    return lean


def default_fused_projections(model: Any) -> bool:
    """On where MLX runs on a GPU, for a quantized model only on MLX's CUDA backend (where the
    lean step's one-row kernel takes its 4-bit products: fewer, wider calls of it); off for a
    quantized model elsewhere (no gain measured with MLX's own kernels) and on the CPU (module
    docstring)."""
    from mlx.nn import QuantizedLinear  # type: ignore[attr-defined]

    if mx.default_device() != mx.gpu:
        return False
    if quantized_gemv.available():
        return True
    return not any(isinstance(m, QuantizedLinear) for m in model.modules())


def prepare_fast_decode(
    model: Any,
    enabled: bool | None,
    fused: bool | None = None,
    *,
    dequantize_from_rows: int | None = None,
) -> CompiledDecode | None:
    """Apply the options to `model` in place (fused projections, when `fused` or `enabled`
    resolve to on; quantized layers routed by rows from `dequantize_from_rows` on: None is the
    backend's default, 0 off, as `quantized_rows.resolve_threshold` says) and return its traced
    decode step, warmed up (`CompiledDecode.warm_up`: every bucket up to 4,096 positions traced
    at load, not in a request), or None where it is off, the model cannot take it or the
    warm-up step fails (logged once; the plain step serves)."""
    if enabled is None:
        enabled = default_compiled_decode()
    if fused is None:
        fused = default_fused_projections(model)
    if not enabled:
        if fused:
            log.info("fused projection groups: %d", fuse_projections(model))
        apply_threshold(model, dequantize_from_rows)
        return None
    groups = fuse_projections(model)
    apply_threshold(model, dequantize_from_rows)
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("compiled decode off: %s (fused projection groups: %d)", reason, groups)
        return None
    decoder = CompiledDecode(model)
    began = time.perf_counter()
    try:
        decoder.warm_up()
    except Exception:  # the traced step cannot run here: serve the plain one
        log.exception("compiled decode off: its warm-up step failed")
        return None
    log.info(
        "compiled decode on (fused projection groups: %d; traced in %.2f s)",
        groups,
        time.perf_counter() - began,
    )
    return decoder
