"""One row times a weight with what comes before and after it in a transformer block, as one
CUDA kernel of our own: the lean step's layer in fewer graph nodes. Runner thread only.

Why: a batch-1 decode step on a GPU is bound by the host, and the host's cost goes by graph node
(build ~1.3 µs, dispatch ~1.9 µs a node on an H100; docs/benchmarks, "The lean one-token step").
Around each projection of a llama block sit nodes that only prepare its input or consume its
output: the RMS norm before q/k/v and before gate/up, the Split and SwiGLU before the down
projection, the residual Add after the o and down projections. Here each projection takes them
in: a layer's 10 nodes from the input norm to the last residual (norm, q/k/v, o, add, norm,
gate/up, split, swiglu, down, add) become 4 kernels, and the final norm joins the output head.

What: `row_product(module, norm=, swiglu=, residual=)` returns, for a plain `nn.Linear` of
bf16/fp16 weights without bias (or a tied `Embedding` used as the head), an affine 4-bit
`QuantizedLinear` of group size 32, 64 or 128 without bias (or a tied `QuantizedEmbedding`), a
function `product(x, r=None)` of a (1, width) row:
- `norm` (an `nn.RMSNorm`): the row is normed first, `norm(x) @ W.T`;
- `swiglu`: the row is a fused gate/up product (1, 2 x K), its SwiGLU is the input,
  `swiglu(gate, up) @ W.T`;
- `residual`: `r + product` (r of shape (1, N)).
Each block of the kernel first writes the product's input row into shared memory as the model's
own nodes would round it (the norm as MLX's `rms_norm` rounds: `T(w x T(x / rms))`; the SwiGLU as
mlx-lm's `swiglu` in the model's dtype), then each warp computes `ROWS` output columns from 16-byte
loads of the weight (the 4-bit form as `quantized_gemv`'s), in float32, and adds the residual to
the product rounded to the model's dtype (`T(r + T(y))`, as the model's Add). More rows, or a row
of another dtype than the weights', go through the model's own modules. None where the kernel does
not apply (not MLX's CUDA backend, another layer type, bias, a row wider than the shared memory).

Numerics: the product sums in float32 in another order than MLX's kernels (cuBLAS for bf16, `qmv`
for 4-bit, which sums in the activations' dtype), so outputs may round differently in the last
place; the norm's sum of squares too (tests/test_row_product.py bounds the difference on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.nn import (  # type: ignore[attr-defined]
    Embedding,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    RMSNorm,
)
from mlx_lm.models.activations import swiglu as model_swiglu

from trio_mlx.engine.quantized_gemv import HEADER, ROWS, WARPS, affine_four_bit, available

__all__ = ["RowProduct", "row_product"]

RowProduct = Callable[..., Any]

#: the widest input row a block stages in shared memory (bytes): the static limit of 48 KiB,
#: less room for the norm's partial sums
SHARED_BYTES = 46 * 1024

# The input row, staged: every thread of the block takes every `threads`-th element.
_STAGE_PLAIN = r"""
  for (int i = tid; i < K / 8; i += threads) {
    reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
  }
"""

_STAGE_NORM = r"""
  __shared__ float partials[32];
  float part = 0.f;
  for (int i = tid; i < K; i += threads) {
    const float v = static_cast<float>(x[i]);
    part += v * v;
  }
  #pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    part += __shfl_xor_sync(0xffffffffu, part, offset);
  }
  if (threadIdx.x == 0) partials[threadIdx.y] = part;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < (int)blockDim.y; ++i) total += partials[i];
  const float inv = rsqrtf(total / K + EPS);
  for (int i = tid; i < K; i += threads) {
    const T normed = static_cast<T>(static_cast<float>(x[i]) * inv);
    xs[i] = static_cast<T>(static_cast<float>(norm_w[i]) * static_cast<float>(normed));
  }
"""

_STAGE_SWIGLU = r"""
  for (int i = tid; i < K; i += threads) {
    const float g = static_cast<float>(x[i]);
    const T gate = static_cast<T>(g * static_cast<float>(static_cast<T>(1.f / (1.f + expf(-g)))));
    xs[i] = static_cast<T>(static_cast<float>(gate) * static_cast<float>(x[K + i]));
  }
"""

# The 32 staged inputs of chunk `chunk` as float32 in xf[32].
_LOAD_X = r"""
      float xf[32];
      #pragma unroll
      for (int v = 0; v < 4; ++v) {
        const uint4 loaded = reinterpret_cast<const uint4*>(xs + chunk * 32)[v];
        const T* e = reinterpret_cast<const T*>(&loaded);
        #pragma unroll
        for (int i = 0; i < 8; ++i) xf[v * 8 + i] = static_cast<float>(e[i]);
      }
"""

_DOT_Q4 = r"""
  constexpr int WORDS = K / 8;
  #pragma unroll
  for (int step = 0; step < STEPS; ++step) {
    const int chunk = step * 32 + lane;
    if (CHUNKS % 32 == 0 || chunk < CHUNKS) {
      uint4 packed[ROWS];
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        packed[r] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)(first + r) * WORDS) + chunk);
      }
{load_x}
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
          for (int t = 0; t < 8; ++t) {
            dot = fmaf(trio_nibble(words[j], 4 * t), xf[j * 8 + t], dot);
          }
        }
        const size_t at = (size_t)(first + r) * (K / GS) + group;
        acc[r] += static_cast<float>(scales[at]) * (16.f * (dot - x_sum))
            + static_cast<float>(biases[at]) * x_sum;
      }
    }
  }
"""

_DOT_DENSE = r"""
  #pragma unroll 2
  for (int step = 0; step < STEPS; ++step) {
    const int chunk = step * 32 + lane;
    if (CHUNKS % 32 == 0 || chunk < CHUNKS) {
      uint4 packed[ROWS][4];
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const uint4* row = reinterpret_cast<const uint4*>(w + (size_t)(first + r) * K + chunk * 32);
        #pragma unroll
        for (int v = 0; v < 4; ++v) packed[r][v] = __ldg(row + v);
      }
{load_x}
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        #pragma unroll
        for (int v = 0; v < 4; ++v) {
          const T* e = reinterpret_cast<const T*>(&packed[r][v]);
          #pragma unroll
          for (int i = 0; i < 8; ++i) {
            acc[r] = fmaf(static_cast<float>(e[i]), xf[v * 8 + i], acc[r]);
          }
        }
      }
    }
  }
"""

_BODY = r"""
  static_assert(sizeof(T) == 2, "16-bit activations");
  constexpr int CHUNKS = K / 32;
  constexpr int STEPS = (CHUNKS + 31) / 32;
  __shared__ uint4 staged[K / 8];                   // the input row, 16-byte aligned
  T* xs = reinterpret_cast<T*>(staged);
  const int tid = threadIdx.y * 32 + threadIdx.x;
  const int threads = 32 * blockDim.y;
{stage}
  __syncthreads();
  const int lane = threadIdx.x;
  const int first = (blockIdx.y * blockDim.y + threadIdx.y) * ROWS;
  if (first >= N) return;
  float acc[ROWS];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
{dot}
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float v = acc[r];
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) {
{store}
    }
  }
"""

_STORE = "      y[first + r] = static_cast<T>(v);"
_STORE_RESIDUAL = (
    "      y[first + r] = static_cast<T>(static_cast<float>(res[first + r])"
    " + static_cast<float>(static_cast<T>(v)));"
)

_kernels: dict[tuple[Any, ...], Any] = {}


def _kernel(quantized: bool, stage: str, residual: bool, eps: float | None) -> Any:
    """The kernel object of one form (compiled per shape at its first call, by NVRTC)."""
    key = (quantized, stage, residual, eps)
    if key not in _kernels:
        names = ["x", "w"] + (["scales", "biases"] if quantized else [])
        names += ["norm_w"] if stage == "norm" else []
        names += ["res"] if residual else []
        stage_source = {"plain": _STAGE_PLAIN, "norm": _STAGE_NORM, "swiglu": _STAGE_SWIGLU}
        source = (
            _BODY.replace("{stage}", stage_source[stage])
            .replace("{dot}", (_DOT_Q4 if quantized else _DOT_DENSE).replace("{load_x}", _LOAD_X))
            .replace("{store}", _STORE_RESIDUAL if residual else _STORE)
        )
        header = HEADER + (f"constexpr float EPS = {float(eps)!r}f;\n" if eps is not None else "")
        form = f"{'q4' if quantized else 'dense'}_{stage}{'_res' if residual else ''}"
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"trio_row_product_{form}_{len(_kernels)}",
            input_names=names,
            output_names=["y"],
            source=source,
            header=header,
            ensure_row_contiguous=True,
        )
    return _kernels[key]


def _weights(module: Any) -> tuple[bool, list[Any], Any] | None:
    """(quantized, the weight arrays the kernel takes, the model's product) for `module`, or
    None where the kernel does not take it."""
    if type(module) in (Linear, Embedding):
        if "bias" in module or module.weight.dtype not in (mx.bfloat16, mx.float16):
            return None
        product = module if type(module) is Linear else module.as_linear
        return False, [module.weight], product
    if not isinstance(module, (QuantizedLinear, QuantizedEmbedding)) or "bias" in module:
        return None
    arrays = affine_four_bit(module)
    if arrays is None:
        return None
    product = module.as_linear if isinstance(module, QuantizedEmbedding) else module
    return True, list(arrays), product


def row_product(
    module: Any, *, norm: Any = None, swiglu: bool = False, residual: bool = False
) -> RowProduct | None:
    """`product(x, r=None)` for `module` with the norm or SwiGLU before it and the residual
    after it, as one kernel for one row (module docstring), or None where the kernel does not
    apply. `norm` must be an `nn.RMSNorm` of the module's input width."""
    if not available() or (norm is not None and swiglu):
        return None
    weights = _weights(module)
    if weights is None:
        return None
    quantized, arrays, model_product = weights
    dtype = arrays[1].dtype if quantized else arrays[0].dtype
    columns = arrays[0].shape[0]
    width = arrays[0].shape[1] * (8 if quantized else 1)
    if width % 32 or width * 2 > SHARED_BYTES:
        return None
    eps = None
    if norm is not None:
        if type(norm) is not RMSNorm or norm.weight.shape != (width,):
            return None
        eps = float(norm.eps)
        norm_weight = norm.weight if norm.weight.dtype == dtype else norm.weight.astype(dtype)
        mx.eval(norm_weight)
        arrays = [*arrays, norm_weight]
    stage = "norm" if norm is not None else "swiglu" if swiglu else "plain"
    kernel = _kernel(quantized, stage, residual, eps)
    rows = ROWS if columns % ROWS == 0 else 1
    template = [("T", dtype), ("K", width), ("N", columns), ("ROWS", rows)]
    if quantized:
        template.append(("GS", module.group_size))
    grid = (32, columns // rows, 1)
    block = (32, WARPS, 1)
    shapes = [(1, columns)]
    dtypes = [dtype]
    row_width = 2 * width if swiglu else width

    def model_path(x: Any, r: Any) -> Any:
        if norm is not None:
            x = norm(x)
        elif swiglu:
            gate, up = mx.split(x, 2, axis=-1)
            x = model_swiglu(gate, up)
        y = model_product(x)
        return y if r is None else r + y

    def product(x: Any, r: Any = None) -> Any:
        if x.dtype != dtype or x.shape != (1, row_width) or (residual and r is None):
            return model_path(x, r)
        inputs = [x, *arrays] + ([r] if residual else [])
        return kernel(
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=block,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )[0]

    return product
