"""What `EngineConfig.compiled_decode` turns on for a loaded model. Runner thread only.

- fused q/k/v and gate/up projections (`fused.fuse_projections`);
- the decode step traced once per KV length bucket and replayed (`compiled_step.CompiledDecode`):
  one sequence's on the serialized route; the batch's on the batched route only with
  `TRIO_MLX_COMPILED_BATCH=on` (experimental: the batch step is traced once per batch size and
  bucket, and under load the batch size changes with every arrival and departure, each new one a
  stall of one trace for every row; `bench/batch_ceiling.py` measures it at fixed sizes).

`None` (the default) means off for now: the traced step is checked token for token on the CPU,
where the host is not what limits a decode step (the device's arithmetic is), but it has not yet
run on a GPU, where it is meant to pay; it becomes the GPU default once measured there
(docs/benchmarks/README.md, "Compiled decode").
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from trio_mlx.engine.compiled_step import CompiledDecode, unsupported_reason
from trio_mlx.engine.fused import fuse_projections

log = logging.getLogger(__name__)


#: Environment switch of the traced batch step (`on` / anything else: off).
COMPILED_BATCH_ENV = "TRIO_MLX_COMPILED_BATCH"


def compiled_batch_enabled() -> bool:
    """Whether the batched route uses the traced batch step (see the module docstring)."""
    return os.environ.get(COMPILED_BATCH_ENV, "").strip().lower() == "on"


def default_compiled_decode() -> bool:
    """Off on every backend until the traced step is measured on a GPU (module docstring)."""
    return False


def prepare_fast_decode(model: Any, enabled: bool | None) -> CompiledDecode | None:
    """Apply the option to `model` (in place: fused projections) and return its traced decode
    step, warmed up (`CompiledDecode.warm_up`: every bucket up to 4,096 positions traced at load,
    not in a request), or None where it is off, the model cannot take it or the warm-up step
    fails (logged once; the plain step serves)."""
    if enabled is None:
        enabled = default_compiled_decode()
    if not enabled:
        return None
    groups = fuse_projections(model)
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
