"""How large the batched route is by default: its sequences (`max_num_seqs`) and the device
memory its KV budget is a share of. Plain functions of the device MLX runs on."""

from __future__ import annotations

import mlx.core as mx

#: `max_num_seqs` on a GPU when none is configured (see the README's "Many users at once").
GPU_MAX_NUM_SEQS = 64


def default_max_num_seqs() -> int:
    """1 on MLX's CPU backend (its step time grows linearly with the batch: 191 ms at 1 sequence,
    1,291 ms at 8 on SmolLM2-135M), `GPU_MAX_NUM_SEQS` on a GPU."""
    return GPU_MAX_NUM_SEQS if mx.default_device() == mx.gpu else 1


def device_memory_bytes() -> int:
    """The device's memory: the GPU's where MLX reports it, else the machine's."""
    info = mx.device_info()
    sizes = [v for k, v in info.items() if "memory" in k and isinstance(v, int) and v > 0]
    if sizes and mx.default_device() == mx.gpu:
        return max(sizes)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
