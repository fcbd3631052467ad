"""A decode step's attention over a batch of rows of very different lengths, without reading every
row at the longest row's length. Runner thread only.

Why: mlx-lm's `BatchKVCache` keeps the rows right-aligned in one buffer as wide as the longest
row, and its decode attention reads every row over that whole width, behind an array mask for the
left padding (on MLX's CUDA backend an array mask also keeps the fused decode kernel out). When a
long prompt joins a batch of short rows, every step of every row then costs what the long row
costs. Measured on an H100 (8B bf16, `python -m bench.long_arrival --long-max-tokens 32`): 16
rows of ~300 positions stepped in 11-13 ms, and 50-59 ms for every step once an 8,000-token row
had joined them; the attention alone, 17 rows over 9,000 positions with the mask, 1.8 ms a layer
(0.9 without the mask), 57 ms a step of 32 layers. With the groups (same host and bench,
`--long-max-tokens 64`): 17-21 ms a step against 52-53 ms (docs/benchmarks/README.md).

What: before each decode step `prepare` takes the positions each row holds once the step has
written its token (exact, from the host: `BatchSequence.cached_length`, and one more for a row
whose previous step is still in flight). Where the batch is wide (at least `MIN_WIDTH` positions)
and reading the short rows over only the last columns they use would at least halve what the step
reads, the rows are split in two groups, the short ones and the long ones, at the split that reads
least; each group attends on its own over its last `window` columns (its longest row's positions:
the rows are right-aligned, so that is where they are): consecutive rows as a view, others
gathered, with mlx-lm's own mask cut to those columns, or none where every row of the group
holds exactly the window (MLX's fused decode kernel then); the outputs are put back in row order.
Every row attends over exactly the positions it did, with the same arithmetic; the sums run over
fewer masked positions, so results equal the plain step's within rounding (the same tokens on
the CPU in the tests).

How it is reached: the plan is put on each `BatchKVCache` layer as its `attend`, which the
attention dispatcher (`decode_attention.install_dispatcher`, in mlx-lm's model modules that
`compiled_step.COMPILABLE_MODULES` lists) calls with the layer's keys, values and mask; a plan that
does not apply (a multi-token pass, no array mask) answers None and mlx-lm's attention runs as
before. The plan holds arrays only, never its layers (no reference cycle, `batch_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

#: Narrower batches step as they are: the split's gathers cost more than they would save.
MIN_WIDTH = 1024
#: Split only where the step would read at most this share of what it reads unsplit.
MAX_SHARE = 0.5
#: `warm_up`'s buffer is this much wider than its keys (a view, as a batch cache's are).
WARM_UP_SPARE_COLUMNS = 16


@dataclass(frozen=True)
class RowGroup:
    """Rows that attend together over their last `window` columns: `rows` a slice where they
    are consecutive (a view, no copy), else their indices; `masked` False where every row of
    the group holds exactly `window` positions (no mask: MLX's fused decode kernel)."""

    rows: Any
    window: int
    masked: bool

    def attend(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        start = keys.shape[2] - min(self.window, keys.shape[2])
        keys = _rows(keys[..., start:, :], self.rows)
        values = _rows(values[..., start:, :], self.rows)
        mask = _rows(mask[..., start:], self.rows) if self.masked else None
        return mx.fast.scaled_dot_product_attention(
            _rows(queries, self.rows), keys, values, scale=scale, mask=mask
        )


def _rows(array: Any, rows: Any) -> Any:
    return array[rows] if isinstance(rows, slice) else mx.take(array, rows, axis=0)


@dataclass(frozen=True)
class RaggedPlan:
    """A step's two row groups (`plan_for`): the short rows and the long ones; `order` puts the
    groups' outputs back in row order (None: they are in it already)."""

    #: the rows and each group's members: what makes two plans' index arrays the same
    members: tuple[tuple[int, ...], tuple[int, ...]]
    rows: int
    groups: tuple[RowGroup, RowGroup]
    order: Any

    def __call__(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        """The attention of a one-token step, grouped; None where the plan does not apply (the
        model's own attention then runs)."""
        if queries.shape[2] != 1 or queries.shape[0] != self.rows:
            return None
        if any(g.masked for g in self.groups) and not (
            isinstance(mask, mx.array) and mask.shape[0] == self.rows
        ):
            return None
        outputs = [g.attend(queries, keys, values, scale, mask) for g in self.groups]
        joined = mx.concatenate(outputs, axis=0)
        return joined if self.order is None else mx.take(joined, self.order, axis=0)


def plan_for(lengths: Sequence[int], previous: RaggedPlan | None = None) -> RaggedPlan | None:
    """The two groups for rows holding these many positions once the step has written its
    token (in row order, exact: a group with no mask attends over exactly its window), or None
    where the batch steps better as one (module docstring); `previous`'s index arrays where its
    groups have the same members."""
    count = len(lengths)
    width = max(lengths, default=0)
    if count < 2 or width < MIN_WIDTH:
        return None
    order = sorted(range(count), key=lengths.__getitem__)
    best: tuple[int, int] | None = None  # (positions read, short rows)
    for k in range(1, count):
        window = lengths[order[k - 1]]
        if window >= width:
            break
        read = k * window + (count - k) * width
        if best is None or read < best[0]:
            best = (read, k)
    if best is None or best[0] > MAX_SHARE * count * width:
        return None
    k = best[1]
    members = (tuple(order[:k]), tuple(order[k:]))
    if previous is not None and previous.members == members:
        indices = [g.rows for g in previous.groups]
        put_back = previous.order
    else:
        indices = [_indices(group) for group in members]
        inverse = [0] * count
        for position, row in enumerate(order[:k] + order[k:]):
            inverse[row] = position
        put_back = None if inverse == list(range(count)) else mx.array(inverse, dtype=mx.uint32)
    short, long = (
        RowGroup(
            rows,
            max(lengths[r] for r in group),
            len({lengths[r] for r in group}) > 1,
        )
        for rows, group in zip(indices, members, strict=True)
    )
    return RaggedPlan(members=members, rows=count, groups=(short, long), order=put_back)


def _indices(rows: tuple[int, ...]) -> Any:
    """A slice where the rows are consecutive and ascending (a view), else an index array."""
    if list(rows) == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return mx.array(rows, dtype=mx.uint32)


def prepare(
    cache: Sequence[Any], lengths: Sequence[int], previous: RaggedPlan | None = None
) -> RaggedPlan | None:
    """Put the plan for rows of `lengths` (`plan_for`) or None on every `BatchKVCache` layer of
    `cache` as its `attend`; return it."""
    plan = plan_for(lengths, previous)
    for layer in cache:
        if type(layer) is BatchKVCache:
            layer.attend = plan  # type: ignore[attr-defined]
    return plan


def warm_up(model: Any) -> bool:
    """Run a grouped attention once, when a batch starts on CUDA (`BatchDecoder`: not on the
    serialized route, nor with the groups off), in the model's head shape and dtype, on small
    arrays: MLX's CUDA backend compiles the gathers' kernels on first use, and on an H100 the
    first grouped step of a fresh process (8B bf16) took 4.2 s. Returns whether it ran (a model
    whose attention the dispatcher does not reach, or whose shape it cannot read: it did not)."""
    from trio_mlx.engine.model_probe import attention_shape

    shape = attention_shape(model)
    if shape is None:
        return False
    heads, kv_heads, dims, dtype = shape
    # one long row; three short ones out of order and of two lengths: index arrays, a mask
    lengths = [MIN_WIDTH, 1, 2, 1]
    plan = plan_for(lengths)
    assert plan is not None
    width = MIN_WIDTH
    buffer = mx.zeros((len(lengths), kv_heads, width + WARM_UP_SPARE_COLUMNS, dims), dtype=dtype)
    keys = buffer[..., :width, :]  # a view of a wider buffer, as `update_and_fetch` gives
    queries = mx.zeros((len(lengths), heads, 1, dims), dtype=dtype)
    padding = mx.array([width - n for n in lengths])
    mask = (mx.arange(width)[None, :] >= padding[:, None])[:, None, None, :]
    grouped = plan(queries, keys, keys, dims**-0.5, mask)
    if grouped is None:
        return False
    mx.eval(grouped)
    return True
