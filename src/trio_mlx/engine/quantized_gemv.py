"""One row times a 4-bit affine-quantized weight, as a CUDA kernel of our own: the decode step's
quantized products near the GPU's memory bandwidth. Runner thread only.

Why (MLX 0.32's CUDA backend, `mlx/backend/cuda/quantized/qmm/qmv.cu`, read at v0.32.1): a
one-row `mx.quantized_matmul` runs `qmv`, one warp per output column, each thread loading 8 bytes
of the packed weight at a time from a loop the compiler cannot unroll (the input width is a
runtime value), so few bytes are in flight per SM and the kernel reads the weight far below the
bandwidth: 0.7-1.0 TB/s on an H100 (3.35 TB/s), on the 8B's shapes. A 4-bit model's batch-1
decode step is then bound by those kernels: the synthetic 8B 4-bit step waited 1.5 ms a token
on the device beyond the host's 4 ms, and decoded barely faster than the same model in bf16.

Measured (H100, `python -m bench.quantized_gemv`, docs/benchmarks "Our 4-bit kernel in the lean
step"): ours reads the weight at 0.9-2.3 TB/s, 1.24-2.23x MLX's speed on those shapes (the
wider the product, the larger the gain), and the 8B 4-bit lean step decodes at 1.45-1.59x raw
mlx-lm's tok/s where it ran at 1.02-1.15x with MLX's kernels. Building a call costs the host
~3.5 µs where MLX's costs ~1.1 µs: fuse the projections (`fused`) so that there are fewer.

What: `quantized_gemv(module)` returns, for an `mlx.nn.QuantizedLinear` (or a tied
`QuantizedEmbedding`'s `as_linear`) of affine 4-bit weights and group size 32, 64 or 128, a
function of a (1, K) row to its (1, N) product, as one kernel (`mx.fast.cuda_kernel`, compiled
by NVRTC at the first call of each shape): each warp computes `ROWS` output columns; each thread
reads 16 bytes (32 weights) of each of its columns per step, with the input width a compile-time
constant so the loop over it unrolls and every load of a thread is issued before the first is
used; the 32 weights are expanded to float32 by bit arithmetic, multiplied by the input in
float32 and summed per group, then scaled (sum x scale + sum(x) x bias, the affine form), and
the warp's lanes are reduced by shuffles. The module's own `bias` (if any) is added after. The
kernel takes one row (the lean step's lone row); more rows, or a row of another dtype than the
scales', go through the module. Anything else (another bit width or mode, the CPU or Metal) is None:
the caller keeps the module's own product.

`quantized_rows_product(module)` is the same arithmetic for 2 to `MAX_ROWS` input rows in one
pass over the weight (each lane expands its 32 weights of a column once and uses them for every
row; the row count is read from the input's shape at run time, so one compile a weight shape),
where MLX's CUDA backend runs `qmv` once a row below 8 rows (`quantized_rows` says more). The
routed quantized layers (`quantized_rows`) use it for such inputs unless `TRIO_MLX_FEW_ROWS=off`
(H100, synthetic 8B 4-bit: a step of 4 rows 15.9 ms against MLX's 22.0 ms).

Numerics: the products and sums are float32 throughout, then rounded once to the input's dtype.
MLX's `qmv` accumulates 4-bit products in the input's dtype (bf16 for a bf16 model), so the two
round differently; ours is the closer of the two to the float32 product of the dequantized
weight (tests/test_quantized_gemv.py, on a CUDA GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

__all__ = [
    "HEADER",
    "MAX_ROWS",
    "affine_four_bit",
    "available",
    "quantized_gemv",
    "quantized_rows_product",
]

#: output columns per warp and warps per block: of (1, 8), (2, 4), (4, 4), (2, 8) on the H100,
#: 2 x 8 was fastest or within 6 % of it on every 8B shape (4 columns a warp lost up to 2x on
#: the down projection's 14,336-wide rows)
ROWS = 2
WARPS = 8

#: `trio_nibble`, the 4-bit weight expansion both kernels here and `row_product`'s use
HEADER = r"""
__device__ __forceinline__ float trio_nibble(uint32_t word, int shift) {
  // 1 + q / 16 for the 4-bit value q at bits [shift, shift + 4): q moved into the mantissa's top
  // bits under the exponent of 1.0, exact, in two operations (shift, and-or)
  const uint32_t moved = shift <= 19 ? word << (19 - shift) : word >> (shift - 19);
  return __uint_as_float(0x3F800000u | (moved & 0x00780000u));
}
"""

# The kernel body (mx.fast.cuda_kernel writes the signature): inputs x (1, K) of type T, w (N,
# K / 8) uint32, scales and biases (N, K / GS); output y (1, N). Launched as a grid of (32, N /
# ROWS) threads in blocks of (32, WARPS): lane threadIdx.x of warp (blockIdx.y * WARPS +
# threadIdx.y), which computes columns [first, first + ROWS).
_SOURCE = r"""
  constexpr int WORDS = K / 8;                      // uint32 words in a weight row
  constexpr int CHUNKS = K / 32;                    // 16-byte chunks (32 weights) in a row
  constexpr int STEPS = (CHUNKS + 31) / 32;         // chunks per lane
  constexpr int X_VECTORS = 32 * sizeof(T) / 16;    // 16-byte loads for 32 inputs
  const int lane = threadIdx.x;
  const int first = (blockIdx.y * blockDim.y + threadIdx.y) * ROWS;
  if (first >= N) return;
  float acc[ROWS];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  #pragma unroll
  for (int step = 0; step < STEPS; ++step) {
    const int chunk = step * 32 + lane;
    if (CHUNKS % 32 == 0 || chunk < CHUNKS) {
      uint4 packed[ROWS];
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        packed[r] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)(first + r) * WORDS) + chunk);
      }
      float xf[32];
      const uint4* xv = reinterpret_cast<const uint4*>(x + chunk * 32);
      #pragma unroll
      for (int v = 0; v < X_VECTORS; ++v) {
        const uint4 loaded = __ldg(xv + v);
        const T* e = reinterpret_cast<const T*>(&loaded);
        #pragma unroll
        for (int i = 0; i < 16 / (int)sizeof(T); ++i) {
          xf[v * (16 / sizeof(T)) + i] = static_cast<float>(e[i]);
        }
      }
      float x_sum = 0.f;
      #pragma unroll
      for (int i = 0; i < 32; ++i) x_sum += xf[i];
      const int group = (chunk * 32) / GS;
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const uint32_t words[4] = {packed[r].x, packed[r].y, packed[r].z, packed[r].w};
        float dot = 0.f;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          #pragma unroll
          for (int t = 0; t < 8; ++t) dot = fmaf(trio_nibble(words[j], 4 * t), xf[j * 8 + t], dot);
        }
        // dot = sum (1 + q / 16) x, so sum q x = 16 (dot - sum x)
        const size_t at = (size_t)(first + r) * (K / GS) + group;
        acc[r] += static_cast<float>(scales[at]) * (16.f * (dot - x_sum))
            + static_cast<float>(biases[at]) * x_sum;
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float v = acc[r];
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) y[first + r] = static_cast<T>(v);
  }
"""

#: the most input rows `quantized_rows_product` takes in one kernel (its accumulators are
#: registers: ROWS x MAX_ROWS floats a thread)
MAX_ROWS = 8

# A few input rows (2 to MAX_ROWS, the row count read from x's shape at run time) in one pass
# over the weight: each lane expands its 32 weights of a column to float32 once per step and
# uses them for every row, so the weight is read once whatever the row count (MLX's kernels read
# it once a row, or dequantize it once a 16-row tile). Inputs x (M, K), w, scales, biases as
# above; output y (M, N). The same grid and sums as the one-row kernel.
_ROWS_SOURCE = r"""
  constexpr int WORDS = K / 8;
  constexpr int CHUNKS = K / 32;
  constexpr int STEPS = (CHUNKS + 31) / 32;
  constexpr int X_VECTORS = 32 * sizeof(T) / 16;
  const int M = x_shape[0];
  const int lane = threadIdx.x;
  const int first = (blockIdx.y * blockDim.y + threadIdx.y) * ROWS;
  if (first >= N) return;
  float acc[ROWS][MAX_M];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    #pragma unroll
    for (int m = 0; m < MAX_M; ++m) acc[r][m] = 0.f;
  }
  #pragma unroll 1
  for (int step = 0; step < STEPS; ++step) {
    const int chunk = step * 32 + lane;
    if (CHUNKS % 32 != 0 && chunk >= CHUNKS) break;
    float wf[ROWS][32];
    float scale[ROWS];
    float bias[ROWS];
    const int group = (chunk * 32) / GS;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const uint4 packed =
          __ldg(reinterpret_cast<const uint4*>(w + (size_t)(first + r) * WORDS) + chunk);
      const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        #pragma unroll
        for (int t = 0; t < 8; ++t) wf[r][j * 8 + t] = trio_nibble(words[j], 4 * t);
      }
      const size_t at = (size_t)(first + r) * (K / GS) + group;
      scale[r] = static_cast<float>(scales[at]);
      bias[r] = static_cast<float>(biases[at]);
    }
    #pragma unroll
    for (int m = 0; m < MAX_M; ++m) {
      if (m < M) {
        float xf[32];
        const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)m * K + chunk * 32);
        #pragma unroll
        for (int v = 0; v < X_VECTORS; ++v) {
          const uint4 loaded = __ldg(xv + v);
          const T* e = reinterpret_cast<const T*>(&loaded);
          #pragma unroll
          for (int i = 0; i < 16 / (int)sizeof(T); ++i) {
            xf[v * (16 / sizeof(T)) + i] = static_cast<float>(e[i]);
          }
        }
        float x_sum = 0.f;
        #pragma unroll
        for (int i = 0; i < 32; ++i) x_sum += xf[i];
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          float dot = 0.f;
          #pragma unroll
          for (int i = 0; i < 32; ++i) dot = fmaf(wf[r][i], xf[i], dot);
          acc[r][m] += scale[r] * (16.f * (dot - x_sum)) + bias[r] * x_sum;
        }
      }
    }
  }
  #pragma unroll
  for (int m = 0; m < MAX_M; ++m) {
    if (m < M) {
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float v = acc[r][m];
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
          v += __shfl_xor_sync(0xffffffffu, v, offset);
        }
        if (lane == 0) y[(size_t)m * N + first + r] = static_cast<T>(v);
      }
    }
  }
"""

_kernels: dict[str, Any] = {}


def available() -> bool:
    """Whether the kernel can run here: MLX's CUDA backend, on the default (GPU) device."""
    return bool(mx.cuda.is_available() and mx.default_device() == mx.gpu)


def _compiled(name: str, source: str) -> Any:
    """The kernel object of `source` (one per name; compiled per shape at its first call)."""
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(
            name=name,
            input_names=["x", "w", "scales", "biases"],
            output_names=["y"],
            source=source,
            header=HEADER,
            ensure_row_contiguous=True,
        )
    return _kernels[name]


def affine_four_bit(module: Any) -> tuple[Any, Any, Any] | None:
    """(weight, scales, biases) of an affine 4-bit layer the kernels take, else None."""
    if getattr(module, "mode", "affine") != "affine" or module.bits != 4:
        return None
    weight, scales, biases = module.weight, module.scales, module.get("biases")
    if module.group_size not in (32, 64, 128) or biases is None or weight.dtype != mx.uint32:
        return None
    if scales.dtype not in (mx.bfloat16, mx.float16):
        return None
    return weight, scales, biases


def quantized_rows_product(module: Any) -> Callable[[Any], Any] | None:
    """For an affine 4-bit layer as `quantized_gemv` takes, a function of an (M, K) matrix of 2
    to `MAX_ROWS` rows to its (M, N) product (plus the module's bias) in one pass over the
    weight, or None where the kernel does not apply (as `quantized_gemv`). Other row counts, or
    rows of another dtype than the scales', return None from the function: the caller keeps
    its own product. The rows must start 16-byte aligned (as `quantized_gemv`'s row)."""
    if not available():
        return None
    arrays = affine_four_bit(module)
    if arrays is None:
        return None
    weight, scales, biases = arrays
    columns = weight.shape[0]
    rows = ROWS if columns % ROWS == 0 else 1
    dtype = scales.dtype
    template = [
        ("T", dtype),
        ("K", weight.shape[1] * 8),
        ("N", columns),
        ("GS", module.group_size),
        ("ROWS", rows),
        ("MAX_M", MAX_ROWS),
    ]
    grid = (32, columns // rows, 1)
    block = (32, WARPS, 1)
    bias = module.get("bias") if "bias" in module else None
    kernel = _compiled("trio_quantized_rows4", _ROWS_SOURCE)

    def product(x: Any) -> Any:
        if x.ndim != 2 or not 2 <= x.shape[0] <= MAX_ROWS or x.dtype != dtype:
            return None
        y = kernel(
            inputs=[x, weight, scales, biases],
            template=template,
            grid=grid,
            threadgroup=block,
            output_shapes=[(x.shape[0], columns)],
            output_dtypes=[dtype],
        )[0]
        return y if bias is None else y + bias

    return product


def quantized_gemv(module: Any) -> Callable[[Any], Any] | None:
    """The kernel's product for `module` (an `nn.QuantizedLinear`, or an `nn.QuantizedEmbedding`
    used as a linear layer) of a (1, K) row, or None where the kernel does not apply (module
    docstring). More rows, or a row of another dtype than the scales', go through the module.
    The kernel reads its row 16 bytes at a time: the row must start 16-byte aligned, as an
    array of its own does (a copy is made of one that is not row-contiguous; an offset view
    into a larger buffer is not supported)."""
    if not available():
        return None
    arrays = affine_four_bit(module)
    if arrays is None:
        return None
    weight, scales, biases = arrays
    group = module.group_size
    columns, words = weight.shape
    width = words * 8
    rows = ROWS if columns % ROWS == 0 else 1
    kernel = _compiled("trio_quantized_gemv4", _SOURCE)
    dtype = scales.dtype
    template = [("T", dtype), ("K", width), ("N", columns), ("GS", group), ("ROWS", rows)]
    grid = (32, columns // rows, 1)
    block = (32, WARPS, 1)
    shapes = [(1, columns)]
    dtypes = [dtype]
    bias = module.get("bias") if "bias" in module else None

    fallback = module.as_linear if hasattr(module, "as_linear") else module

    def product(x: Any) -> Any:
        if x.dtype != dtype or x.shape[0] != 1:
            return fallback(x)
        y = kernel(
            inputs=[x, weight, scales, biases],
            template=template,
            grid=grid,
            threadgroup=block,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )[0]
        return y if bias is None else y + bias

    return product
