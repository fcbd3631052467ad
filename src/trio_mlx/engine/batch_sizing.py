"""How large the batched route is by default: its sequences (`max_num_seqs`) and the device
memory its KV budget is a share of. Plain functions of the device MLX runs on."""

from __future__ import annotations

import mlx.core as mx

#: `max_num_seqs` on a GPU when none is configured (see the README's "Many users at once").
GPU_MAX_NUM_SEQS = 64
#: `max_num_seqs` on MLX's CPU backend when none is configured. With float32 weights through
#: OpenBLAS (`cpu_path`) a decode step is bound by reading the weights, which a step reads once
#: for all its rows: SmolLM2-135M on 2 cores, 8 streams at once, 52 tok/s aggregate batched
#: against 12 serialized, each stream's ITL ~118 ms against ~77 alone (`bench.token_path`,
#: docs/benchmarks/2026-12-05-cpu-max-num-seqs-smollm2.md). 16 slots did not beat 8 there.
CPU_MAX_NUM_SEQS = 8


def default_max_num_seqs() -> int:
    """`GPU_MAX_NUM_SEQS` on a GPU, `CPU_MAX_NUM_SEQS` on MLX's CPU backend."""
    return GPU_MAX_NUM_SEQS if mx.default_device() == mx.gpu else CPU_MAX_NUM_SEQS


def device_memory_bytes() -> int:
    """The device's memory: the GPU's where MLX reports it, else the machine's."""
    info = mx.device_info()
    sizes = [v for k, v in info.items() if "memory" in k and isinstance(v, int) and v > 0]
    if sizes and mx.default_device() == mx.gpu:
        return max(sizes)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
