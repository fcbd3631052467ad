"""The one-token forward pass of a llama-family model, written for decode: the model's own
arithmetic in fewer graph nodes. Runner thread only.

Why: on a GPU a batch-1 decode step is bound by the host, not the device. MLX builds every node of
the step's graph in Python and dispatches each from C++, whatever the node computes: a view costs
about what a kernel launch does (on an H100 the fused 1B bf16 step's 619 nodes took 0.80 ms to
build and 1.18 ms to dispatch, ~3 µs a node; docs/benchmarks, "The lean one-token step").
mlx-lm's llama forward pass over a (1, 1) input makes ~38 nodes a layer. Most are bookkeeping of
the batch and sequence axes a decode step does not have: each `nn.Linear` on a 3-D input is
Transpose + Flatten + Matmul + Unflatten (the weight transposed anew every call, the input's
leading axes folded and unfolded), and each of q, k, v and the attention's output is reshaped
and transposed between (B, L, H, D) and (B, H, L, D).

What: `LeanStep` feeds one token as a (1, hidden) row and keeps it 2-D: every unquantized
projection is one Matmul against its weight transposed once, at construction (a view of the same
buffer: nothing copied), or one AddMM with its bias; with `quantized_kernel` (the default), a
4-bit quantized projection on MLX's CUDA backend is one call of our one-row kernel
(`quantized_gemv`: ~2x MLX's kernel there). Where q, k and v are fused
(`fused.fuse_projections`), their product is reshaped once to (1, heads, 1, head_dim) (with one
position, (B, L, H, D) and (B, H, L, D) are the same memory) and split along the heads; without
qwen3's q/k norms, q and k stay one array through the rotary embedding (one kernel, not two: the
rotation is per head). The attention's output goes back by one Reshape. ~20 nodes a layer, 13 of
them kernels (on an H100 the 1B step built in ~0.44 ms, the model's own fused step in 0.80).
With `row_kernels` (MLX's CUDA backend; `row_product`), a lone row's block goes further: its
four products take in the norms, the SwiGLU and the residual adds around them (q/k/v with the
input norm, o with the residual, gate/up with the post-attention norm, down with the SwiGLU and
the residual), and the head takes the final norm: ~14 nodes a layer, 4 of them our kernels.
Everything else is the model's own code, called as the model calls it: the embedding, the norms
(`input_layernorm`, ..., qwen3's `q_norm` / `k_norm`), the rotary embedding at the cache's
offset, `KVCache.update_and_fetch`, mlx-lm's `swiglu`, other quantized projections (any module
that is not a plain `nn.Linear` is called as is) and the output head.

Where: the architectures whose traced step is known (`compiled_step.unsupported_reason`: mlx-lm's
llama, qwen2, qwen3 without sliding-window layers), over a cache of plain `KVCache` layers
(`fits`). A step over anything else is the model's own forward pass. `batch_logits` takes a
batch's rows over the batch's cache the same way, with the model's own mask and attention calls
(the batched route uses it with `TRIO_MLX_LEAN_BATCH=on`, `engine/batch.py`).

Output: on the CPU the same products and the same kernels on the same shapes, so in float32 the
logits equal the model's own (tests/test_lean_step.py); on a GPU a kernel chosen for a
differently laid-out but equal operand may round differently, and our 4-bit kernel sums in
float32 where MLX's sums in the activations' dtype (`quantized_gemv`: the closer of the two).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx.nn import Embedding, Linear, QuantizedEmbedding, QuantizedLinear  # type: ignore[attr-defined]
from mlx_lm.models.activations import swiglu

from trio_mlx.engine.compiled_step import CompiledDecode, unsupported_reason
from trio_mlx.engine.quantized_gemv import quantized_gemv
from trio_mlx.engine.row_product import RowProduct, row_product

__all__ = ["LeanStep"]

Projection = Callable[[Any], Any]


def _against(weight: Any, bias: Any = None) -> Projection:
    """(rows, K) times `weight` transposed (once, here: a view of the weight's buffer, with no
    graph behind it), as one Matmul, or one AddMM with `bias`."""
    transposed = weight.T
    mx.eval(transposed)
    if bias is not None:
        return lambda x: mx.addmm(bias, x, transposed)
    return lambda x: x @ transposed


def _projection(module: Any, quantized_kernel: bool) -> Projection:
    """`module` applied to (rows, K): a plain `nn.Linear` against its weight transposed once
    (`_against`); with `quantized_kernel`, a 4-bit quantized layer through our one-row kernel
    where it applies (`quantized_gemv`: more rows go through the module); anything else as the
    module itself."""
    if type(module) is not Linear:
        if quantized_kernel and isinstance(module, QuantizedLinear):
            return quantized_gemv(module) or module
        return module  # type: ignore[no-any-return]
    return _against(module.weight, module.bias if "bias" in module else None)


def _head_module(model: Any) -> Any:
    """The module whose weight is the output head's: `lm_head`, or the tied input embedding."""
    if getattr(model.args, "tie_word_embeddings", False):
        return model.model.embed_tokens
    return model.lm_head


def _head(model: Any, quantized_kernel: bool) -> Projection:
    """The output head: `lm_head`, or the input embedding used as a linear layer (tied)."""
    embed = _head_module(model)
    if embed is not model.model.embed_tokens:
        return _projection(embed, quantized_kernel)
    if type(embed) is not Embedding:
        if quantized_kernel and isinstance(embed, QuantizedEmbedding):
            return quantized_gemv(embed) or embed.as_linear
        return embed.as_linear  # type: ignore[no-any-return]
    return _against(embed.weight)


class _Batch:
    """What a batch step's layers share: the mask of the batch's cache (as mlx-lm's
    `create_attention_mask` makes it for one position) and the attention of the model's module
    (looked up at each step: the engine may have put a dispatcher in its place)."""

    __slots__ = ("attend", "mask")

    def __init__(self, module: Any, first: Any) -> None:
        self.attend = module.scaled_dot_product_attention
        make_mask = getattr(first, "make_mask", None)
        self.mask = (
            None if make_mask is None else make_mask(1, return_array=False, window_size=None)
        )


class _RowKernels:
    """A block's four products as `row_product` kernels: the input norm with q/k/v, o with the
    residual, the post-attention norm with gate/up, the SwiGLU with down and the residual."""

    __slots__ = ("down", "norm_gate_up", "norm_qkv", "out")

    def __init__(self, qkv: RowProduct, out: RowProduct, gate_up: RowProduct, down: RowProduct):
        self.norm_qkv, self.out, self.norm_gate_up, self.down = qkv, out, gate_up, down

    @classmethod
    def of(cls, layer: Any) -> _RowKernels | None:
        """The kernels of `layer`, or None unless every one applies (fused q/k/v and gate/up
        projections, no q/k norms, layers and norms the kernel takes)."""
        attn, mlp = layer.self_attn, layer.mlp
        if "qkv_proj" not in attn or "gate_up_proj" not in mlp or "q_norm" in attn:
            return None
        products = (
            row_product(attn.qkv_proj, norm=layer.input_layernorm),
            row_product(attn.o_proj, residual=True),
            row_product(mlp.gate_up_proj, norm=layer.post_attention_layernorm),
            row_product(mlp.down_proj, swiglu=True, residual=True),
        )
        if any(product is None for product in products):
            return None
        return cls(*products)  # type: ignore[arg-type]


class _Layer:
    """One transformer block's pieces, looked up once."""

    __slots__ = (
        "attention_inputs",
        "down",
        "gate_up",
        "heads",
        "input_norm",
        "kernels",
        "kv_heads",
        "out",
        "post_norm",
        "project",
        "qk_norm",
        "qkv",
        "rope",
        "scale",
    )

    def __init__(self, layer: Any, quantized_kernel: bool, row_kernels: bool = False) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.project: Callable[[Any], Projection] = lambda m: _projection(m, quantized_kernel)
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.heads = attn.n_heads
        self.kv_heads = attn.n_kv_heads
        self.scale = attn.scale
        self.rope = attn.rope
        self.out = self.project(attn.o_proj)
        self.down = self.project(mlp.down_proj)
        self.gate_up = self._gate_up(mlp)
        self.qk_norm: Callable[[Any, Any], tuple[Any, Any]] | None = None
        if "q_norm" in attn:  # qwen3: each head's queries and keys normalized
            q_norm, k_norm = attn.q_norm, attn.k_norm
            self.qk_norm = lambda q, k: (q_norm(q), k_norm(k))
        #: q and k rotated to position `offset` (after qwen3's norms) and v, of the normed rows
        #: `h`, each shaped (rows, heads, 1, head_dim)
        self.attention_inputs: Callable[[Any, int], tuple[Any, Any, Any]]
        if "qkv_proj" in attn and self.qk_norm is None:
            fused = self.project(attn.qkv_proj)
            self.attention_inputs = lambda h, offset: self._split_rotated(fused(h), offset)
        else:
            self.qkv = self._qkv(attn)
            self.attention_inputs = self._rotated_apart
        #: a lone row's block through `row_product` kernels (`LeanStep`'s `row_kernels`)
        self.kernels = _RowKernels.of(layer) if row_kernels else None

    def _qkv(self, attn: Any) -> Callable[[Any], tuple[Any, Any, Any]]:
        """q, k and v of (rows, hidden), each shaped (rows, heads, 1, head_dim): where they are
        fused, one product, one Reshape of it to (rows, all heads, 1, head_dim) and one Split
        along the heads (each part a contiguous run of the product)."""
        if "qkv_proj" not in attn:
            q, k, v = (self.project(attn[name]) for name in ("q_proj", "k_proj", "v_proj"))
            hq, hk = self.heads, self.kv_heads
            return lambda h: (
                q(h).reshape(h.shape[0], hq, 1, -1),
                k(h).reshape(h.shape[0], hk, 1, -1),
                v(h).reshape(h.shape[0], hk, 1, -1),
            )
        fused = self.project(attn.qkv_proj)
        heads = self.heads + 2 * self.kv_heads
        split_at = [self.heads, self.heads + self.kv_heads]
        return lambda h: tuple(  # type: ignore[return-value]
            mx.split(fused(h).reshape(h.shape[0], heads, 1, -1), split_at, axis=1)
        )

    def _rotated_apart(self, h: Any, offset: int) -> tuple[Any, Any, Any]:
        """`attention_inputs`: q and k each through the rotary embedding."""
        q, k, v = self.qkv(h)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        return self.rope(q, offset=offset), self.rope(k, offset=offset), v

    def _split_rotated(self, qkv: Any, offset: int) -> tuple[Any, Any, Any]:
        """q, k (rotated to `offset`) and v of a fused, unnormed q/k/v product `qkv`: q and k, a
        contiguous run of the product's heads, go through the rotary embedding as one array (one
        kernel instead of two: the rotation is per head)."""
        heads = self.heads + 2 * self.kv_heads
        qk, v = mx.split(qkv.reshape(qkv.shape[0], heads, 1, -1), [heads - self.kv_heads], axis=1)
        q, k = mx.split(self.rope(qk, offset=offset), [self.heads], axis=1)
        return q, k, v

    def _gate_up(self, mlp: Any) -> Callable[[Any], tuple[Any, Any]]:
        """The MLP's gate and up products: one product and a Split where they are fused."""
        if "gate_up_proj" not in mlp:
            gate, up = self.project(mlp.gate_proj), self.project(mlp.up_proj)
            return lambda m: (gate(m), up(m))
        fused = self.project(mlp.gate_up_proj)
        width = mlp.gate_up_proj.weight.shape[0] // 2
        return lambda m: tuple(mx.split(fused(m), [width], axis=-1))  # type: ignore[return-value]

    def __call__(self, x: Any, cache: Any, batch: _Batch | None = None) -> Any:
        """The block over `x`, (rows, hidden): one row over its own cache (`batch` None), or a
        batch's rows over the batch's cache layer, attending as the model's module does."""
        if batch is None and self.kernels is not None:
            return self._through_kernels(x, cache, self.kernels)
        q, k, v = self.attention_inputs(self.input_norm(x), cache.offset)
        k, v = cache.update_and_fetch(k, v)
        if batch is None:
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        else:
            o = batch.attend(q, k, v, cache=cache, scale=self.scale, mask=batch.mask)
        h = x + self.out(o.reshape(x.shape[0], -1))
        gate, up = self.gate_up(self.post_norm(h))
        return h + self.down(swiglu(gate, up))

    def _through_kernels(self, x: Any, cache: Any, kernels: _RowKernels) -> Any:
        """The block over one row `x` with its products as `row_product` kernels."""
        q, k, v = self._split_rotated(kernels.norm_qkv(x), cache.offset)
        k, v = cache.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        h = kernels.out(o.reshape(1, -1), x)
        return kernels.down(kernels.norm_gate_up(h), h)


class LeanStep:
    """The lean one-token step of one model (module docstring). Build it after the model's
    projections are fused (it keeps what it finds); drop it with the model (it holds views of
    its weights)."""

    def __init__(
        self, model: Any, *, quantized_kernel: bool = True, row_kernels: bool = False
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        inner = model.model
        self._module = sys.modules[type(model).__module__]
        self._embed = inner.embed_tokens
        self._layers = [_Layer(layer, quantized_kernel, row_kernels) for layer in inner.layers]
        self._norm = inner.norm
        self._head = _head(model, quantized_kernel)
        #: a lone row's final norm and head as one `row_product` kernel, where it applies
        self._norm_head = row_product(_head_module(model), norm=inner.norm) if row_kernels else None
        #: how many blocks take a lone row through `row_product` kernels (`row_kernels`)
        self.kernel_layers = sum(layer.kernels is not None for layer in self._layers)

    #: whether a sequence's cache can take the lean step: every layer a plain `KVCache`, as the
    #: traced step's
    fits = staticmethod(CompiledDecode.fits)

    def logits(self, token: Any, cache: Sequence[Any]) -> Any:
        """Feed `token` (shape (1,), possibly lazy) over `cache` (advanced by one position);
        return the next position's logits, shape (1, vocab). Lazy."""
        x = self._embed(token)
        for layer, layer_cache in zip(self._layers, cache, strict=True):
            x = layer(x, layer_cache)
        if self._norm_head is not None:
            return self._norm_head(x)
        return self._head(self._norm(x))

    def batch_logits(self, tokens: Any, cache: Sequence[Any]) -> Any:
        """Feed `tokens` (shape (rows,), one a row) over a batch's `cache` (advanced by one
        position a row); return each row's next logits, shape (rows, vocab). The model's own
        calls on the batch's cache (its offsets, `update_and_fetch`, `make_mask`, the module's
        attention with the cache and mask), in the lean layout. Lazy."""
        batch = _Batch(self._module, cache[0])
        x = self._embed(tokens)
        for layer, layer_cache in zip(self._layers, cache, strict=True):
            x = layer(x, layer_cache, batch)
        return self._head(self._norm(x))

    def step(self, token: Any, cache: Sequence[Any], *, greedy: bool) -> Any:
        """`logits`, or with `greedy` the next token (shape (1,), uint32): the decode step's
        interface, as `compiled_step.CompiledDecode.step`'s."""
        logits = self.logits(token, cache)
        return mx.argmax(logits, axis=-1) if greedy else logits
