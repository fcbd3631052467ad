"""A decode step that carries a waiting prompt's next prefill chunk: the batch's rows and the
chunk in one forward pass. Runner thread only.

Why: while rows decode, a long prompt is admitted a chunk per step, and on a GPU each chunk is a
forward pass of its own. Its fixed cost is that of reading every weight once, which is what a
decode step costs too: on the H200's 8B bf16 a 128-token chunk took ~18 ms beside a 9-13 ms
decode step of 16 rows (docs/benchmarks, "A long prompt arriving at a busy batch"), so the
running streams' gap was ~2.7x a plain one at the median of the admission, near issue 16's 3x
bound for its p99. In one pass the projections and MLPs read their weights once for the rows'
tokens and the chunk's together: the chunk adds its own arithmetic, not a second pass.

How: the pass runs the model's own `__call__` on one sequence of `rows + n` tokens (the rows'
inputs, then the chunk's), with a `MixedLayer` as each layer's cache:
- RoPE rotates each token by its own position (`true_positions.PositionedRoPE`): a row's next
  position (the batch cache's `offset`, as the plain step's RoPE reads it), the chunk's from its
  sequence's cached length;
- `update_and_fetch` writes the rows' keys and values into the batch cache (as `rows` one-token
  rows) and the chunk's into its sequence's own cache (or views of it over its width bucket,
  `prefill_shapes`), keeping what each returns;
- `make_mask` (asked once, of the first layer's) gives both masks, the batch's for one token and
  the chunk's for its length, as the plain passes would have made them;
- the attention (`attend`, reached through `decode_attention.install_dispatcher`) splits the
  queries and attends each part over its own keys (the rows through the batch cache's own
  `attend` where it has one, `ragged_attention`), then joins the outputs in token order.
The output layer runs over the rows' positions only (the model's trunk, then its head: a chunk's
positions need no logits). Everything else a layer does is
token-wise, so each token's output is what its own pass gives (up to the rounding of a matrix
product over more rows: on the CPU backend in float32, the same greedy tokens, tests).

Where: `mixable` — a model whose attention reaches the dispatcher (`COMPILABLE_MODULES`) with a
RoPE module to wrap; rows on a batch cache of plain `BatchKVCache` layers or a lone row's
`KVCache`, no row at a rope delta (a prompt with media), no traced step; a waiting sequence whose
chunks go through the batch's model on plain `KVCache` layers (not scoring, no media, no draft).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine import true_positions
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.compiled_step import COMPILABLE_MODULES
from trio_mlx.engine.decode_attention import install_dispatcher


@dataclass(frozen=True)
class _Masks:
    """The two parts' masks, as their plain passes would make them."""

    rows: Any
    chunk: Any


class MixedLayer:
    """One layer's cache for one mixed pass: the first `rows` tokens are the batch's rows (one
    each, on `rows_layer`), the rest one chunk of a waiting sequence (on `chunk_layer`)."""

    def __init__(self, rows_layer: Any, chunk_layer: Any, rows: int) -> None:
        self._rows_layer = rows_layer
        self._chunk_layer = chunk_layer
        self._rows = rows
        self._rows_kv: tuple[Any, Any] | None = None
        self._chunk_kv: tuple[Any, Any] | None = None

    @property
    def offset(self) -> int:
        return 0  # RoPE takes each token's position from `PositionedRoPE`

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> _Masks:
        options = {"return_array": return_array, "window_size": window_size}
        return _Masks(
            self._rows_layer.make_mask(1, **options),
            self._chunk_layer.make_mask(n - self._rows, **options),
        )

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        b = self._rows
        self._rows_kv = self._rows_layer.update_and_fetch(_as_rows(keys, b), _as_rows(values, b))
        self._chunk_kv = self._chunk_layer.update_and_fetch(keys[:, :, b:, :], values[:, :, b:, :])
        return keys, values  # the attention reads the parts kept here (`attend`)

    def attend(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        assert self._rows_kv is not None and self._chunk_kv is not None
        assert isinstance(mask, _Masks)
        b = self._rows
        rows = _attention(self._rows_layer, _as_rows(queries, b), *self._rows_kv, scale, mask.rows)
        chunk = _attention(
            self._chunk_layer, queries[:, :, b:, :], *self._chunk_kv, scale, mask.chunk
        )
        self._rows_kv = self._chunk_kv = None
        return mx.concatenate([rows.transpose(2, 1, 0, 3), chunk], axis=2)


def _as_rows(x: Any, rows: int) -> Any:
    """The first `rows` tokens of a (1, heads, tokens, dim) array as `rows` one-token rows:
    (rows, heads, 1, dim)."""
    return x[:, :, :rows, :].transpose(2, 1, 0, 3)


def _attention(layer: Any, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
    attend = getattr(layer, "attend", None)
    if attend is not None:
        result = attend(queries, keys, values, scale, mask)
        if result is not None:
            return result
    return scaled_dot_product_attention(queries, keys, values, cache=layer, scale=scale, mask=mask)


def prepare(model: Any) -> bool:
    """Make `model` able to take mixed passes (the dispatcher, the RoPE wrapper); False where it
    cannot (`mixable`'s model half)."""
    if type(model).__module__ not in COMPILABLE_MODULES:
        return False
    install_dispatcher(COMPILABLE_MODULES)
    return true_positions.install_positioned_rope(model)


def mixable(cache: list[Any], seq: BatchSequence) -> bool:
    """Whether the batch's `cache` and `seq`'s next chunk can share a pass (module docstring)."""
    if not cache or seq.cache is None or seq.prefill_model is not None or seq.scoring:
        return False
    if seq.media or seq.draft is not None or seq.remaining_prompt() <= 0:
        return False
    rows_kind = type(cache[0])
    if rows_kind not in (BatchKVCache, KVCache) or any(type(c) is not rows_kind for c in cache):
        return False
    return all(type(c) is KVCache for c in seq.cache)


def forward(
    model: Any, inputs: Any, cache: list[Any], seq: BatchSequence, limit: int, *, rungs: bool
) -> tuple[Any, int, tuple[int, ...]]:
    """One mixed pass: the rows' `inputs` (one token each) on the batch's `cache` and `seq`'s
    next chunk of at most `limit` tokens (`BatchSequence.next_chunk`); return the rows' logits
    (rows, vocab), lazy, the prompt tokens the chunk took, and the store points it reached.
    The chunk's cache is written by the same lazy graph (queued with the step)."""
    rows = int(inputs.shape[0])
    n, padding = seq.next_chunk(limit, rungs=rungs)
    tokens, layers = seq.chunk_input(model, n, padding)
    first = cache[0]
    row_positions = first.offset if type(first) is BatchKVCache else mx.array([first.offset])
    chunk_start = seq.prompt_done
    positions = mx.concatenate(
        [
            row_positions.astype(mx.int32),
            mx.arange(chunk_start, chunk_start + n + padding, dtype=mx.int32),
        ]
    )
    mixed = [MixedLayer(r, c, rows) for r, c in zip(cache, layers, strict=True)]
    with true_positions.token_positions(positions):
        hidden = model.model(mx.concatenate([inputs.astype(tokens.dtype), tokens])[None], mixed)
    return _head(model, hidden[0, :rows, :]), n, seq.chunk_done(n, padding, evaluate=False)


def _head(model: Any, hidden: Any) -> Any:
    """The output layer over the rows' hidden states only, as the model's `__call__` applies it
    (the chunk's positions need none: a prefill keeps no logits)."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
