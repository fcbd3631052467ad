"""One-kernel attention of one query position over a bucketed KV buffer, for the traced decode step
on MLX's CUDA backend (experimental, off unless asked: `TRIO_MLX_DECODE_ATTENTION=kernel`).

Why: inside the traced step (`compiled_step`) attention runs over a whole KV bucket with an array
mask for the valid positions, and MLX's CUDA backend has no fused kernel that takes one for a
single query (its vector kernel and its cuDNN decode path take none), so it computes attention
unfused: scale, a batched matrix-vector product, the mask, a softmax, another product, five kernels
per layer where the plain path launches one. On a GPU where a decode step is bound by launching
kernels that undoes part of what the trace saves. This kernel does the same arithmetic in one
launch, reading the valid length from the step's offset array on the device.

Arithmetic: one thread block per (sequence, query head); each warp walks a strided share of the
valid positions with an online softmax in float32 (running maximum, running sum, the weighted
value accumulated across the warp's lanes, `head_dim / 32` elements each), then the warps' partial
results are merged through shared memory. Grouped-query attention: query head `h` reads key/value
head `h // (n_heads / n_kv_heads)`. The result equals softmax(q k^T * scale) v over positions
`0..offset` up to float32 rounding of a different summation order.

`install_dispatcher` puts a dispatcher in place of `scaled_dot_product_attention` in the model
modules the traced step knows (`COMPILABLE_MODULES`): a call whose cache has an `attend` goes there
first (the traced step's layer, `_TracedLayer.attend`; a batch layer's `ragged_attention` plan),
every other call, and one its `attend` declines (None), to mlx-lm's own function, unchanged.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import mlx.core as mx

__all__ = [
    "ENV",
    "decode_attention",
    "install_dispatcher",
    "kernel_requested",
    "reference_attention",
    "supported",
]

ENV = "TRIO_MLX_DECODE_ATTENTION"
#: Warps per thread block.
WARPS = 8

_SOURCE = """
    const int bh = blockIdx.y;
    const int h = bh % HQ;
    const int b = bh / HQ;
    const int kvh = h / (HQ / HKV);
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int positions = keys_shape[2];
    const int valid = min(static_cast<int>(offset[0]) + 1, positions);
    constexpr int PER = D / 32;
    const float NEG_INF = -__int_as_float(0x7f800000);

    float qv[PER];
    const T* qp = queries + static_cast<size_t>(bh) * D + lane * PER;
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(qp[i]) * SCALE;
    }
    const size_t base = (static_cast<size_t>(b) * HKV + kvh) * positions * D + lane * PER;
    float m = NEG_INF;
    float l = 0.0f;
    float acc[PER];
    for (int i = 0; i < PER; ++i) {
        acc[i] = 0.0f;
    }
    for (int p = warp; p < valid; p += NW) {
        const T* kp = keys + base + static_cast<size_t>(p) * D;
        float s = 0.0f;
        for (int i = 0; i < PER; ++i) {
            s += qv[i] * static_cast<float>(kp[i]);
        }
        for (int delta = 16; delta > 0; delta /= 2) {
            s += __shfl_xor_sync(0xffffffff, s, delta);
        }
        const float m_new = fmaxf(m, s);
        const float correction = __expf(m - m_new);
        const float w = __expf(s - m_new);
        l = l * correction + w;
        const T* vp = values + base + static_cast<size_t>(p) * D;
        for (int i = 0; i < PER; ++i) {
            acc[i] = acc[i] * correction + w * static_cast<float>(vp[i]);
        }
        m = m_new;
    }
    __shared__ float shared_m[NW];
    __shared__ float shared_l[NW];
    __shared__ float shared_acc[NW * D];
    if (lane == 0) {
        shared_m[warp] = m;
        shared_l[warp] = l;
    }
    for (int i = 0; i < PER; ++i) {
        shared_acc[warp * D + lane * PER + i] = acc[i];
    }
    __syncthreads();
    if (warp == 0) {
        float top = NEG_INF;
        for (int w = 0; w < NW; ++w) {
            top = fmaxf(top, shared_m[w]);
        }
        float total = 0.0f;
        float result[PER];
        for (int i = 0; i < PER; ++i) {
            result[i] = 0.0f;
        }
        for (int w = 0; w < NW; ++w) {
            const float c = shared_l[w] > 0.0f ? __expf(shared_m[w] - top) : 0.0f;
            total += shared_l[w] * c;
            for (int i = 0; i < PER; ++i) {
                result[i] += shared_acc[w * D + lane * PER + i] * c;
            }
        }
        T* op = out + static_cast<size_t>(bh) * D + lane * PER;
        for (int i = 0; i < PER; ++i) {
            op[i] = static_cast<T>(result[i] / total);
        }
    }
"""

_kernels: dict[float, Any] = {}


def kernel_requested() -> bool:
    """`TRIO_MLX_DECODE_ATTENTION=kernel` and MLX's CUDA backend is the default device."""
    if os.environ.get(ENV, "").strip().lower() != "kernel":
        return False
    return bool(mx.default_device() == mx.gpu and mx.cuda.is_available())


def supported(queries: Any, keys: Any) -> bool:
    """Shapes the kernel takes: one query position, a head size that is a multiple of 32 (at
    most 256), whole groups of query heads per key/value head."""
    _, n_heads, length, dim = queries.shape
    n_kv = keys.shape[1]
    return bool(length == 1 and dim % 32 == 0 and dim <= 256 and n_heads % n_kv == 0)


def decode_attention(queries: Any, keys: Any, values: Any, offset: Any, scale: float) -> Any:
    """softmax(q k^T * scale) v over key positions `0..offset` (an int32 scalar array), for
    `queries` of shape (B, n_heads, 1, D) and `keys`/`values` of shape (B, n_kv_heads, S, D)."""
    kernel: Any = _kernels.get(scale)
    if kernel is None:
        source = _SOURCE.replace("SCALE", f"{float(scale)!r}f")
        kernel = _kernels[scale] = mx.fast.cuda_kernel(
            name=f"trio_decode_attention_{len(_kernels)}",
            input_names=["queries", "keys", "values", "offset"],
            output_names=["out"],
            source=source,
        )
    batch, n_heads, _, dim = queries.shape
    (out,) = kernel(
        inputs=[queries, keys, values, offset],
        template=[
            ("T", queries.dtype),
            ("D", dim),
            ("HQ", n_heads),
            ("HKV", keys.shape[1]),
            ("NW", WARPS),
        ],
        grid=(32 * WARPS, batch * n_heads, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )
    return out


def reference_attention(queries: Any, keys: Any, values: Any, offset: Any, scale: float) -> Any:
    """What `decode_attention` computes, in MLX operations (float32; for tests and the bench)."""
    n_heads, n_kv = queries.shape[1], keys.shape[1]
    q = queries.astype(mx.float32) * scale
    k = mx.repeat(keys.astype(mx.float32), n_heads // n_kv, axis=1)
    v = mx.repeat(values.astype(mx.float32), n_heads // n_kv, axis=1)
    scores = q @ k.swapaxes(-1, -2)
    valid = mx.arange(keys.shape[2]) <= offset
    scores = mx.where(valid, scores, -mx.inf)
    return (mx.softmax(scores, axis=-1) @ v).astype(queries.dtype)


def install_dispatcher(modules: frozenset[str]) -> None:
    """Route `scaled_dot_product_attention` in each model module to its cache's `attend` where
    the cache has one (the traced layer's, a batch's `ragged_attention` plan) and it answers
    (idempotent; every other call reaches mlx-lm's function unchanged)."""
    for name in sorted(modules):
        module = importlib.import_module(name)
        original = getattr(module, "scaled_dot_product_attention", None)
        if original is None or getattr(original, "_trio_dispatcher", False):
            continue

        def dispatch(
            queries: Any,
            keys: Any,
            values: Any,
            cache: Any,
            scale: float,
            mask: Any,
            sinks: Any = None,
            _original: Any = original,
        ) -> Any:
            attend = getattr(cache, "attend", None)
            if attend is not None and sinks is None:
                result = attend(queries, keys, values, scale, mask)
                if result is not None:
                    return result
            return _original(
                queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
            )

        dispatch._trio_dispatcher = True  # type: ignore[attr-defined]
        setattr(module, "scaled_dot_product_attention", dispatch)  # noqa: B010
