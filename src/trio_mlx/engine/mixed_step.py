"""A decode step that carries waiting prompts' next prefill chunks: the batch's rows and the
chunks in one forward pass. Runner thread only.

Why: while rows decode, a long prompt is admitted a chunk per step, and on a GPU each chunk is a
forward pass of its own. Its fixed cost is that of reading every weight once, which is what a
decode step costs too: on the H200's 8B bf16 a 128-token chunk took ~18 ms beside a 9-13 ms
decode step of 16 rows (docs/benchmarks, "A long prompt arriving at a busy batch"), so the
running streams' gap was ~2.7x a plain one at the median of the admission, near issue 16's 3x
bound for its p99. In one pass the projections and MLPs read their weights once for the rows'
tokens and the chunks' together: a chunk adds its own arithmetic, not a second pass. Several
prompts' chunks may share the pass (`BatchDecoder._mixed_pass`: a short prompt arriving behind a
long one takes what the long one's chunk leaves of the step's budget).

How: the pass runs the model's own trunk on one sequence of `rows + n1 + n2 + ...` tokens (the
rows' inputs, then each chunk's), with a `MixedLayer` as each layer's cache:
- RoPE rotates each token by its own position (`true_positions.PositionedRoPE`): a row's next
  position (the batch cache's `offset`, as the plain step's RoPE reads it), a chunk's from its
  sequence's cached length;
- `update_and_fetch` writes the rows' keys and values into the batch cache (as `rows` one-token
  rows) and each chunk's into its sequence's own cache (or views of it over its width bucket,
  `prefill_shapes`), keeping what each returns;
- `make_mask` (asked once, of the first layer's) gives every part's mask, the batch's for one
  token and each chunk's for its length, as the plain passes would have made them;
- the attention (`attend`, reached through `decode_attention.install_dispatcher`) splits the
  queries and attends each part over its own keys (the rows through the batch cache's own
  `attend` where it has one, `ragged_attention`), then joins the outputs in token order.
The output layer runs over the rows' positions only (the trunk, then the model's head: a chunk's
positions need no logits). Everything else a layer does is token-wise, so each token's output is
what its own pass gives (up to the rounding of a matrix product over more rows: on the CPU
backend in float32, the same greedy tokens, tests).

Where: `mixable` — a model whose attention reaches the dispatcher (`COMPILABLE_MODULES`) with a
RoPE module to wrap; rows on a batch cache of plain `BatchKVCache` layers (or rows in groups of
their own buffers, `batch_segments`, whose own `attend` the rows' part goes through) or a lone
row's `KVCache`, no row at a rope delta (a prompt with media), no traced step; a waiting
sequence whose chunks go through the batch's model on plain `KVCache` layers (not scoring, no
media, no draft).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine import true_positions
from trio_mlx.engine.batch_prefill import can_group
from trio_mlx.engine.batch_segments import SegmentedKVCache
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.compiled_step import COMPILABLE_MODULES
from trio_mlx.engine.decode_attention import install_dispatcher

#: Chunks of different sequences one pass carries at most (each is an attention of its own in
#: every layer).
MAX_CHUNKS = 8


@dataclass(frozen=True)
class Chunk:
    """A waiting sequence's next chunk as a mixed pass takes it: `n` prompt tokens and the
    `padding` that makes them whole blocks (`BatchSequence.next_chunk`), planned once."""

    seq: BatchSequence
    n: int
    padding: int


def plan(seq: BatchSequence, limit: int, *, rungs: bool = True) -> Chunk:
    """`seq`'s next chunk of at most `limit` tokens (with `rungs`, on the ladder a pass beside
    decoding rows takes)."""
    n, padding = seq.next_chunk(limit, rungs=rungs)
    return Chunk(seq, n, padding)


@dataclass(frozen=True)
class _Masks:
    """The parts' masks, as their plain passes would make them: the rows', then each chunk's."""

    rows: Any
    chunks: tuple[Any, ...]


class MixedLayer:
    """One layer's cache for one mixed pass: the first `rows` tokens are the batch's rows (one
    each, on `rows_layer`), then a chunk of `sizes[i]` tokens of each waiting sequence (on
    `chunk_layers[i]`)."""

    def __init__(
        self, rows_layer: Any, chunk_layers: Sequence[Any], rows: int, sizes: Sequence[int]
    ) -> None:
        self._rows_layer = rows_layer
        self._chunk_layers = list(chunk_layers)
        self._rows = rows
        self._sizes = list(sizes)
        self._fetched: list[tuple[Any, Any]] = []  # the rows', then each chunk's keys and values

    @property
    def offset(self) -> int:
        return 0  # RoPE takes each token's position from `PositionedRoPE`

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> _Masks:
        options = {"return_array": return_array, "window_size": window_size}
        return _Masks(
            self._rows_layer.make_mask(1, **options),
            tuple(
                layer.make_mask(size, **options)
                for layer, size in zip(self._chunk_layers, self._sizes, strict=True)
            ),
        )

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        b = self._rows
        self._fetched = [self._rows_layer.update_and_fetch(_as_rows(keys, b), _as_rows(values, b))]
        for layer, (start, end) in zip(self._chunk_layers, self._spans(), strict=True):
            part = layer.update_and_fetch(keys[:, :, start:end, :], values[:, :, start:end, :])
            self._fetched.append(part)
        return keys, values  # the attention reads the parts kept here (`attend`)

    def attend(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        assert len(self._fetched) == 1 + len(self._chunk_layers)
        assert isinstance(mask, _Masks)
        (keys_rows, values_rows), *chunks_fetched = self._fetched
        queries_rows = _as_rows(queries, self._rows)
        rows = _attention(self._rows_layer, queries_rows, keys_rows, values_rows, scale, mask.rows)
        outputs = [rows.transpose(2, 1, 0, 3)]
        for layer, (start, end), (k, v), chunk_mask in zip(
            self._chunk_layers, self._spans(), chunks_fetched, mask.chunks, strict=True
        ):
            chunk_queries = queries[:, :, start:end, :]
            outputs.append(
                _attention(layer, chunk_queries, k, v, scale, chunk_mask, own_layout=True)
            )
        self._fetched = []
        return mx.concatenate(outputs, axis=2)

    def _spans(self) -> list[tuple[int, int]]:
        """Where each chunk's tokens are in the pass."""
        spans, start = [], self._rows
        for size in self._sizes:
            spans.append((start, start + size))
            start += size
        return spans


def _as_rows(x: Any, rows: int) -> Any:
    """The first `rows` tokens of a (1, heads, tokens, dim) array as `rows` one-token rows:
    (rows, heads, 1, dim)."""
    return x[:, :, :rows, :].transpose(2, 1, 0, 3)


def _attention(
    layer: Any,
    queries: Any,
    keys: Any,
    values: Any,
    scale: float,
    mask: Any,
    *,
    own_layout: bool = False,
) -> Any:
    """`layer`'s attention: its own `attend` where it has one (a padded view, which copies the
    queries row-contiguous itself; the batch cache's ragged attention), else MLX's, with
    `own_layout` on queries copied row-contiguous first. A chunk's queries sliced from the pass
    keep the whole pass's strides, and on MLX's CUDA backend the cuDNN attention graph is keyed
    by the strides as well as the shape: those change with the rows and the other chunks in the
    pass, so every new mix would build a graph of its own (50-150 ms), none of them one that
    `prefill_shapes.warm_graphs` built (row-contiguous queries). The copy is exact."""
    attend = getattr(layer, "attend", None)
    if attend is not None:
        result = attend(queries, keys, values, scale, mask)
        if result is not None:
            return result
    if own_layout:
        queries = mx.contiguous(queries)
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
    if rows_kind not in (BatchKVCache, SegmentedKVCache, KVCache) or any(
        type(c) is not rows_kind for c in cache
    ):
        return False
    return all(type(c) is KVCache for c in seq.cache)


def choose_chunks(
    waiting: Sequence[BatchSequence], cache: list[Any], limit: int, *, grouping: bool, step: int
) -> list[Chunk]:
    """The waiting sequences' next chunks that ride in the decode pass, `limit` prompt tokens in
    all (padding counted): the first not ready takes its chunk first, then the next ones in
    admission order take what is left (a short prompt behind a long one is not held until the
    long one is in), up to `MAX_CHUNKS`. None where the first cannot ride (it takes a chunk of
    its own), or, with `grouping`, is a new short prompt that a group pass takes with its
    companions (`batch_prefill.can_group`, prompts of at most `step` tokens)."""
    pending = [s for s in waiting if not s.ready]
    if not pending or not mixable(cache, pending[0]):
        return []
    head = pending[0]
    if grouping and head.chunks_run == 0 and can_group(head, step):
        return []
    chunks: list[Chunk] = []
    budget = limit
    for seq in pending:
        if budget <= 0 or len(chunks) == MAX_CHUNKS:
            break
        if mixable(cache, seq):
            chunk = plan(seq, budget)
            chunks.append(chunk)
            budget -= chunk.n + chunk.padding
    return chunks


def forward(
    model: Any, inputs: Any, cache: list[Any], chunks: Sequence[Chunk]
) -> tuple[Any, list[tuple[int, tuple[int, ...]]]]:
    """One mixed pass: the rows' `inputs` (one token each) on the batch's `cache` and the
    planned `chunks` (`plan`, `choose_chunks`); return the rows' logits (rows, vocab), lazy, and
    per chunk the prompt tokens it took and the store points it reached. The chunks' caches are
    written by the same lazy graph (queued with the step)."""
    rows = int(inputs.shape[0])
    first = cache[0]
    row_positions = first.offset if type(first) is not KVCache else mx.array([first.offset])
    parts, positions, sizes, layers = [inputs.astype(mx.uint32)], [row_positions], [], []
    for seq, n, padding in ((c.seq, c.n, c.padding) for c in chunks):
        tokens, seq_layers = seq.chunk_input(model, n, padding)
        parts.append(tokens.astype(mx.uint32))
        positions.append(mx.arange(seq.prompt_done, seq.prompt_done + n + padding))
        sizes.append(n + padding)
        layers.append(seq_layers)
    mixed = [
        MixedLayer(r, [seq_layers[i] for seq_layers in layers], rows, sizes)
        for i, r in enumerate(cache)
    ]
    every = mx.concatenate([p.astype(mx.int32) for p in positions])
    with true_positions.token_positions(every):
        hidden = model.model(mx.concatenate(parts)[None], mixed)
    done = [(c.n, c.seq.chunk_done(c.n, c.padding, evaluate=False)) for c in chunks]
    return _head(model, hidden[0, :rows, :]), done


def _head(model: Any, hidden: Any) -> Any:
    """The output layer over the rows' hidden states only, as the model's `__call__` applies it
    (the chunk's positions need none: a prefill keeps no logits)."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
