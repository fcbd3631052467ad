"""A one-token decode step traced once per cache length bucket and replayed (`mx.compile`).
Runner thread only.

Why: on a fast GPU a plain decode step costs what the host spends building its graph in Python
(the model's `__call__`, every layer, every op: 0.8-2.2 ms per token on the H200) and dispatching
it, not what the device needs. A traced step replays the recorded graph from C++ (no Python per
op), with MLX's compile-time fusion of elementwise ops (fewer kernels to dispatch).

What it takes: `mx.compile` replays a graph only for inputs of the shapes it was traced with, and a
KV cache grows by one position per token. So the step runs over a KV buffer of fixed size, a
*bucket* (`bucket_size`: 256, 512, 1024, 2048, 4096 positions, then multiples of 4096), with the
write position and the RoPE offset as an `mx.array` input (not a Python int, which the trace would
bake in) and attention masked to the valid positions. A sequence's cache grows by buckets: the
step that needs a position past the bucket first copies the cache into the next one. One trace
per (bucket, variant) is kept by `mx.compile`'s own cache and shared by every sequence.

The cache stays mlx-lm's `KVCache`, whose buffer may be larger than its `offset` (as mlx-lm's own
grows in steps of 256): this module only re-lays `keys`/`values` into a bucket-sized buffer and
advances `offset` by one per step. So prefill, prefix-cache snapshots and restores, trimming and
everything else that reads the cache works unchanged.

Variants: `greedy` (the argmax inside the trace: a plain greedy request without logprobs) and
`logits` (the last position's logits, for the sampler, logits processors, penalties and
logprobs, which stay outside the trace exactly as on the plain path).

Which models: the step hands the model stand-in cache objects whose `offset` is an array, so it
is only for architectures whose forward pass uses a layer's cache exactly as mlx-lm's llama does
(`offset` for RoPE only, `update_and_fetch`, `make_mask`): `COMPILABLE_MODULES`, with every
layer's cache a plain `KVCache` (no rotating, quantized or recurrent cache). Anything else runs
the plain path (`unsupported_reason` says why).

Attention: by default the model's own (`mx.fast.scaled_dot_product_attention` with the mask); on
MLX's CUDA backend `TRIO_MLX_DECODE_ATTENTION=kernel` (experimental) computes it in one custom
kernel instead (`decode_attention`).

The batched route (`batch.BatchDecoder`, `batch_logits`): mlx-lm's `BatchKVCache` writes every
row at one position (`_idx`, rows left-padded) and keeps per-row RoPE offsets as an array (its own
mask is an array already), so the traced batch step takes the tokens (B,), `_idx`, the offsets and
the left padding as arrays, buckets the buffer by `_idx`, masks `left_padding <= position <= _idx`
per row, and returns the logits; sampling stays per row outside the trace. One trace per
(B, bucket): a batch size seen for the first time in a bucket traces once (tens of milliseconds on
a large model), which is why the batched route takes it only when asked (`fast_decode`). Padding
B up a short ladder (1, 2, 4, ... 64) inside `BatchDecoder` (spare rows kept in the batch cache,
attending to their own position only) would bound the traces at the price of computing the
spare rows: not done.

Numerics: on the CPU backend (float32), greedy tokens equal the plain path's (tests). On a GPU the
masked attention over the bucket is computed by MLX's unfused attention (its fused decode kernels
take no array mask), and compile fuses elementwise ops, so logits differ by rounding; greedy
tokens can differ where two logits tie within it (`bench/compiled_decode.py` reports agreement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine import decode_attention

__all__ = [
    "COMPILABLE_MODULES",
    "FIRST_BUCKET",
    "CompiledDecode",
    "bucket_size",
    "unsupported_reason",
]

#: The smallest KV bucket (positions); buckets double up to `LINEAR_BUCKETS_FROM`.
FIRST_BUCKET = 256
#: From this size on, buckets grow by this many positions (bounded over-allocation for long
#: sequences: at most 4,096 spare positions instead of doubling).
LINEAR_BUCKETS_FROM = 4096

#: mlx-lm model modules whose forward pass uses a layer's cache as the traced step needs (read:
#: `offset` only as the RoPE offset, then `update_and_fetch`, and the mask from `make_mask`).
COMPILABLE_MODULES = frozenset(
    {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}
)


def bucket_size(positions: int, first: int = FIRST_BUCKET) -> int:
    """The KV buffer size (positions) that holds `positions`: `first` doubled until it does, up to
    `LINEAR_BUCKETS_FROM`, beyond that the next multiple of `LINEAR_BUCKETS_FROM`."""
    if positions < 1:
        raise ValueError(f"a bucket holds at least one position, not {positions}")
    size = first
    while size < positions and size < LINEAR_BUCKETS_FROM:
        size *= 2
    if size >= positions:
        return size
    return -(-positions // LINEAR_BUCKETS_FROM) * LINEAR_BUCKETS_FROM


def unsupported_reason(model: Any) -> str | None:
    """Why the traced step cannot run `model` (None: it can)."""
    kind = type(model)
    if kind.__name__ != "Model" or kind.__module__ not in COMPILABLE_MODULES:
        return f"{kind.__module__}.{kind.__qualname__} is not a model the traced step knows"
    layer_types = getattr(getattr(model, "args", None), "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return "the model has sliding-window layers"
    return None


class _TracedLayer:
    """One layer's cache as the model sees it inside the trace: a fixed-size buffer, the write
    position as an array, attention masked to the positions written so far."""

    __slots__ = ("_kernel", "_mask", "_start", "keys", "offset", "values")

    def __init__(
        self, keys: Any, values: Any, offset: Any, start: Any, mask: Any, kernel: bool
    ) -> None:
        self.keys = keys
        self.values = values
        self.offset = offset  # int32 array, scalar or one per row: RoPE takes it as is
        self._start = start.reshape(1)  # where the new position is written (every row)
        self._mask = mask
        self._kernel = kernel

    def attend(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any = None) -> Any:
        """Attention by `decode_attention`'s kernel where it is on and takes these shapes, else
        None (the model's own attention then runs, with `make_mask`'s mask)."""
        if not self._kernel or not decode_attention.supported(queries, keys):
            return None
        return decode_attention.decode_attention(queries, keys, values, self.offset, scale)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        self.keys = mx.slice_update(self.keys, keys, self._start, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n != 1 or window_size is not None:
            raise ValueError("the traced decode step takes one token and no sliding window")
        return self._mask


class CompiledDecode:
    """The traced one-token decode step of one model (see the module docstring). One per model;
    every sequence shares its traces."""

    def __init__(
        self, model: Any, *, first_bucket: int = FIRST_BUCKET, attention_kernel: bool | None = None
    ) -> None:
        self._model = model
        self.first_bucket = first_bucket
        #: attention by `decode_attention`'s CUDA kernel (None: as `TRIO_MLX_DECODE_ATTENTION`)
        self.attention_kernel = (
            decode_attention.kernel_requested() if attention_kernel is None else attention_kernel
        )
        if self.attention_kernel:
            decode_attention.install_dispatcher(COMPILABLE_MODULES)
        self._greedy = mx.compile(lambda *a: self._trace(True, *a))
        self._logits = mx.compile(lambda *a: self._trace(False, *a))
        self._batch = mx.compile(self._trace_batch)

    @staticmethod
    def fits(cache: Sequence[Any]) -> bool:
        """Whether a sequence's cache can take the traced step: every layer a plain `KVCache`
        (`step` also needs it to hold at least one position)."""
        return bool(cache) and all(type(c) is KVCache for c in cache)

    def step(self, token: Any, cache: Sequence[Any], *, greedy: bool) -> Any:
        """Feed `token` (shape (1,), possibly lazy) through the model over `cache` (advanced by
        one position); return the next token (shape (1,), uint32) when `greedy`, else the
        logits (shape (1, vocab)). Lazy: nothing is evaluated here."""
        offset = cache[0].offset
        size = bucket_size(offset + 1, self.first_bucket)
        for layer in cache:
            if layer.keys.shape[2] != size:
                layer.keys, layer.values = (
                    _relaid(layer.keys, offset, size),
                    _relaid(layer.values, offset, size),
                )
        arrays = [a for layer in cache for a in (layer.keys, layer.values)]
        traced = self._greedy if greedy else self._logits
        head, *state = traced(token.astype(mx.uint32), mx.array(offset, dtype=mx.int32), *arrays)
        for i, layer in enumerate(cache):
            layer.keys, layer.values = state[2 * i], state[2 * i + 1]
            layer.offset = offset + 1
        return head

    def warm_up(self, up_to: int = LINEAR_BUCKETS_FROM) -> bool:
        """Trace both variants for every bucket up to `up_to` positions, and run one step of
        each at the first bucket (so that the device's kernels for them are compiled), so that
        no request pays for it; returns False (nothing done) when the model's fresh cache does
        not fit the traced step. Raises whatever the trace or the step raises. Larger buckets are
        traced on inputs never evaluated: no memory is allocated for them."""
        cache = self._one_token_cache()
        if cache is None:
            return False
        token = mx.array([0], dtype=mx.uint32)
        for greedy in (True, False):
            mx.eval(self.step(token, cache, greedy=greedy))
        for size in self._buckets(bucket_size(cache[0].offset + 1, self.first_bucket), up_to):
            arrays = _zero_buffers(cache, 1, size)
            for traced in (self._greedy, self._logits):
                traced(token, mx.array(0, dtype=mx.int32), *arrays)  # traced, never evaluated
        return True

    def _one_token_cache(self) -> list[Any] | None:
        """A fresh cache of the model holding one position, or None where it does not fit the
        traced step (`fits`). The position is not evaluated: the cache gives the buffers'
        shapes and dtypes."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self._model)
        if not self.fits(cache):
            return None
        self._model(mx.array([[0]], dtype=mx.uint32), cache=cache)
        return cache

    def _buckets(self, after: int, up_to: int) -> list[int]:
        """The bucket sizes past `after`, up to the first that reaches `up_to`."""
        sizes = []
        size = after
        while size < up_to:
            size = bucket_size(size + 1, self.first_bucket)
            sizes.append(size)
        return sizes

    def _trace(self, greedy: bool, tokens: Any, offset: Any, *arrays: Any) -> list[Any]:
        valid = mx.arange(arrays[0].shape[2]) <= offset
        layers = [
            _TracedLayer(arrays[i], arrays[i + 1], offset, offset, valid, self.attention_kernel)
            for i in range(0, len(arrays), 2)
        ]
        logits = self._model(tokens.reshape(1, 1), cache=layers)[:, -1, :]
        head = mx.argmax(logits, axis=-1) if greedy else logits
        return [head, *(a for layer in layers for a in (layer.keys, layer.values))]

    # ---- the batched route ------------------------------------------------------------------

    @staticmethod
    def batch_fits(cache: Sequence[Any]) -> bool:
        """Whether a decode batch's cache can take the traced batch step: every layer mlx-lm's
        `BatchKVCache` (left-padded rows, one write position), holding at least one position."""
        return bool(cache) and all(type(c) is BatchKVCache and c.keys is not None for c in cache)

    def batch_logits(self, tokens: Any, cache: Sequence[Any]) -> Any:
        """Feed each row's token (shape (B,)) through the model over the batch's `cache`
        (advanced by one position, as `BatchKVCache.update_and_fetch` would); return the logits
        (shape (B, vocab)), lazily. One trace per (B, bucket)."""
        first = cache[0]
        idx = first._idx
        size = bucket_size(idx + 1, self.first_bucket)
        for layer in cache:
            if layer.keys.shape[2] != size:
                layer.keys = _relaid(layer.keys, idx, size)
                layer.values = _relaid(layer.values, idx, size)
        arrays = [a for layer in cache for a in (layer.keys, layer.values)]
        logits, offset, *state = self._batch(
            tokens.astype(mx.uint32),
            mx.array(idx, dtype=mx.int32),
            first.offset.astype(mx.int32),
            first.left_padding.astype(mx.int32),
            *arrays,
        )
        for i, layer in enumerate(cache):  # every layer's offsets are the same values
            layer.keys, layer.values = state[2 * i], state[2 * i + 1]
            layer.offset = offset
            layer._idx = idx + 1
        return logits

    def warm_up_batch(self, rows: range, up_to: int = LINEAR_BUCKETS_FROM) -> bool:
        """Trace the batch step for each number of `rows` and every bucket up to `up_to`
        positions and run it once on zeroed buffers, so that no step of a running batch pays
        for a trace or for the device compiling the trace's fused kernels (on MLX's CUDA
        backend, source compiled on first use: an H100 spent 27.5 s in a server's first
        requests on the 1B bf16 shape when only the traces were made ahead). The buffers are
        freed after each. False (nothing done) where the model's cache cannot take the traced
        step. Raises whatever a trace or a step raises."""
        cache = self._one_token_cache()
        if cache is None:
            return False
        for b in rows:
            for size in self._buckets(0, up_to):
                arrays = _zero_buffers(cache, b, size)
                index = mx.zeros((b,), dtype=mx.int32)
                mx.eval(
                    self._batch(
                        mx.zeros((b,), dtype=mx.uint32),
                        mx.array(0, dtype=mx.int32),
                        index,
                        index,
                        *arrays,
                    )
                )
                del arrays
        mx.clear_cache()
        return True

    def _trace_batch(
        self, tokens: Any, idx: Any, offset: Any, left_padding: Any, *arrays: Any
    ) -> list[Any]:
        positions = mx.arange(arrays[0].shape[2])[None]
        valid = (positions <= idx) & (positions >= left_padding[:, None])
        mask = valid[:, None, None, :]
        layers = [
            _TracedLayer(arrays[i], arrays[i + 1], offset, idx, mask, False)
            for i in range(0, len(arrays), 2)
        ]
        logits = self._model(tokens[:, None], cache=layers)[:, -1, :]
        return [logits, offset + 1, *(a for layer in layers for a in (layer.keys, layer.values))]


def _zero_buffers(cache: Sequence[Any], rows: int, size: int) -> list[Any]:
    """Zeroed key and value buffers shaped as `cache`'s, of `rows` rows and `size` positions,
    in the traced steps' argument order (each layer's keys, then its values)."""
    return [
        mx.zeros((rows, a.shape[1], size, a.shape[3]), dtype=a.dtype)
        for layer in cache
        for a in (layer.keys, layer.values)
    ]


def _relaid(buffer: Any, offset: int, size: int) -> Any:
    """`buffer`'s first `offset` positions (axis 2) in a zero-filled buffer of `size` positions."""
    kept = buffer[..., :offset, :]
    shape = list(buffer.shape)
    shape[2] = size - offset
    return mx.concatenate([kept, mx.zeros(shape, dtype=buffer.dtype)], axis=2)
