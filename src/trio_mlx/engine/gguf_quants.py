"""GGML block formats that trio-mlx decodes itself rather than through MLX's GGUF loader.

- BF16: MLX's loader narrows it to float16 (losing range); here it stays bfloat16.
- Q4_K: each super-block of 256 values is eight groups of 32 with their own scale and minimum
  (`value = d * scale[g] * q - dmin * min[g]`, q in 0..15): exactly MLX's affine 4-bit format with
  group size 32, so it is repacked losslessly (scales and biases in float32, where the products
  are exact). MLX's own loader dequantizes Q4_K with the wrong scale for every second group.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

Q4_K_BLOCK_BYTES = 144


def bf16_array(raw: bytes, shape: tuple[int, ...]) -> mx.array:
    """A bfloat16 array from GGUF BF16 tensor bytes."""
    bits = np.frombuffer(raw, dtype="<u2").reshape(shape)
    return mx.array(bits).view(mx.bfloat16)


def q4_k_to_mlx(raw: bytes, shape: tuple[int, ...]) -> tuple[mx.array, mx.array, mx.array]:
    """(weight uint32, scales, biases) in MLX's affine 4-bit, group-32 layout for a Q4_K tensor
    of `shape` (rows, cols), cols a multiple of 256."""
    rows, cols = shape
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, Q4_K_BLOCK_BYTES)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
    dmin = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    packed = blocks[:, 4:16].astype(np.uint32)
    # Eight 6-bit scales and eight 6-bit mins in 12 bytes: groups 0-3 in the low six bits of
    # bytes 0-3 (scales) and 4-7 (mins); groups 4-7 in the nibbles of bytes 8-11, with their top
    # two bits in the high bits of bytes 0-3 (scales) and 4-7 (mins).
    scale_q = np.concatenate(
        [packed[:, 0:4] & 63, (packed[:, 8:12] & 0xF) | ((packed[:, 0:4] >> 6) << 4)], axis=1
    )
    min_q = np.concatenate(
        [packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1
    )
    scales = d * scale_q.astype(np.float32)
    biases = -(dmin * min_q.astype(np.float32))
    # 128 quant bytes: four runs of 32 bytes; a run's low nibbles are one group, its high the next.
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 256)
    # MLX packs eight 4-bit values per uint32, the first in the lowest bits.
    pairs = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    weight = np.ascontiguousarray(pairs).view("<u4").reshape(rows, cols // 8)
    return (
        mx.array(weight),
        mx.array(scales.reshape(rows, cols // 32)),
        mx.array(biases.reshape(rows, cols // 32)),
    )
