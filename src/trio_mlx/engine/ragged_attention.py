"""A decode step's attention over a batch of rows of very different lengths, without reading every
row at the longest row's length. Runner thread only.

Why: mlx-lm's `BatchKVCache` keeps the rows right-aligned in one buffer as wide as the longest
row, and its decode attention reads every row over that whole width, behind an array mask for the
left padding (on MLX's CUDA backend an array mask also keeps the fused decode kernel out). When a
long prompt joins a batch of short rows, every step of every row then costs what the long row
costs. Measured on an H100 (8B bf16, `python -m bench.long_arrival --long-max-tokens 32`): 16
rows of ~300 positions stepped in 11-13 ms, and 50-59 ms for every step once an 8,000-token row
had joined them; the attention alone, 17 rows over 9,000 positions with the mask, 1.8 ms a layer
(0.9 without the mask), 57 ms a step of 32 layers.

What: before each decode step `prepare` looks at the rows' cached lengths (known on the host,
`BatchSequence.cached_length`). Where the batch is wide (at least `MIN_WIDTH` positions) and
reading the short rows over only the last columns they use would at least halve what the step
reads, the rows are split in two groups, the short ones and the long ones, at the split that reads
least; each group then attends on its own: its rows' queries, keys, values and mask rows gathered,
the short group's over only the last `window` columns (the rows are right-aligned, so that is
where their positions are: the longest short row's length plus `SLACK`, in blocks of
`WINDOW_BLOCK`), and the results put back in row order. The mask is mlx-lm's own, cut to the same
columns, so every row attends over exactly the positions it did. The arithmetic is the same per
row (softmax over the same keys); the sums run over fewer masked positions, so results equal the
plain step's within rounding (bit-equal on the CPU in the tests).

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
#: The short group's window is its longest row plus this many positions (a step in flight may
#: have fed a token the host has not counted yet), rounded up to a whole number of blocks.
SLACK = 4
WINDOW_BLOCK = 256
#: Split only where the step would read at most this share of what it reads unsplit.
MAX_SHARE = 0.5
#: `warm_up`'s buffer is this much wider than its keys (a view, as a batch cache's are).
MIN_STEP_SLICE = 16


@dataclass(frozen=True)
class RaggedPlan:
    """A step's two row groups (`prepare`): `short` rows attend over their last `window` columns,
    `long` rows over all of them; `order` puts the groups' outputs back in row order."""

    #: the rows, the window and the short rows, in order: what makes two plans the same
    key: tuple[int, int, tuple[int, ...]]
    rows: int
    window: int
    short: Any
    long: Any
    order: Any

    def __call__(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        """The attention of a one-token step, grouped; None where the plan does not apply (the
        model's own attention then runs)."""
        if queries.shape[2] != 1 or queries.shape[0] != self.rows or not isinstance(mask, mx.array):
            return None
        if mask.shape[0] != self.rows:
            return None
        width = keys.shape[2]
        window = min(self.window, width)
        outputs = [
            _group(queries, keys, values, mask, self.short, width - window, scale),
            _group(queries, keys, values, mask, self.long, 0, scale),
        ]
        return mx.take(mx.concatenate(outputs, axis=0), self.order, axis=0)


def _group(
    queries: Any, keys: Any, values: Any, mask: Any, rows: Any, start: int, scale: float
) -> Any:
    """Attention of the rows `rows` over the columns from `start` on."""
    keys = mx.take(keys[..., start:, :], rows, axis=0)
    values = mx.take(values[..., start:, :], rows, axis=0)
    mask = mx.take(mask[..., start:], rows, axis=0)
    return mx.fast.scaled_dot_product_attention(
        mx.take(queries, rows, axis=0), keys, values, scale=scale, mask=mask
    )


def plan_for(lengths: Sequence[int], previous: RaggedPlan | None = None) -> RaggedPlan | None:
    """The two groups for rows of these cached lengths (in row order), or None where the batch
    steps better as one (module docstring); `previous` where its groups are the same (its
    arrays are on the device already)."""
    count = len(lengths)
    width = max(lengths, default=0) + SLACK
    if count < 2 or width < MIN_WIDTH:
        return None
    order = sorted(range(count), key=lengths.__getitem__)
    best: tuple[int, int, int] | None = None  # (positions read, short rows, window)
    for k in range(1, count):
        window = _window(lengths[order[k - 1]])
        if window >= width:
            break
        read = k * window + (count - k) * width
        if best is None or read < best[0]:
            best = (read, k, window)
    if best is None or best[0] > MAX_SHARE * count * width:
        return None
    _, k, window = best
    key = (count, window, tuple(order[:k]))
    if previous is not None and previous.key == key:
        return previous
    inverse = [0] * count
    for position, row in enumerate(order):
        inverse[row] = position
    return RaggedPlan(
        key=key,
        rows=count,
        window=window,
        short=mx.array(order[:k], dtype=mx.uint32),
        long=mx.array(order[k:], dtype=mx.uint32),
        order=mx.array(inverse, dtype=mx.uint32),
    )


def _window(length: int) -> int:
    needed = length + SLACK
    return -(-needed // WINDOW_BLOCK) * WINDOW_BLOCK


def prepare(
    cache: Sequence[Any], lengths: Sequence[int], previous: RaggedPlan | None = None
) -> RaggedPlan | None:
    """Put the plan for rows of `lengths` (or None) on every `BatchKVCache` layer of `cache` as
    its `attend` (`previous`: the last step's plan, `plan_for`); return it."""
    plan = plan_for(lengths, previous)
    for layer in cache:
        if type(layer) is BatchKVCache:
            layer.attend = plan  # type: ignore[attr-defined]
    return plan


def warm_up(model: Any) -> bool:
    """Run a grouped attention once at load, in the model's head shape and dtype, on small
    arrays: MLX's CUDA backend compiles the gathers' kernels on first use, and on an H100 the
    first grouped step of a fresh process (8B bf16) took 4.2 s. Returns whether it ran (a model
    whose attention the dispatcher does not reach, or whose shape it cannot read: it did not)."""
    from trio_mlx.engine.compiled_step import COMPILABLE_MODULES

    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if type(model).__module__ not in COMPILABLE_MODULES or not heads:
        return False
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    dims = getattr(args, "head_dim", None) or getattr(args, "hidden_size", 0) // heads
    embed = model.model.embed_tokens  # these modules' models all have it
    dtype = getattr(embed, "scales", embed.weight).dtype  # a quantized one: its scales'
    lengths = [MIN_WIDTH, 1, 1, 1]  # one long row, three short ones
    plan = plan_for(lengths)
    assert plan is not None
    width = MIN_WIDTH + 2
    buffer = mx.zeros((len(lengths), kv_heads, width + MIN_STEP_SLICE, dims), dtype=dtype)
    keys = buffer[..., :width, :]  # a view of a wider buffer, as `update_and_fetch` gives
    queries = mx.zeros((len(lengths), heads, 1, dims), dtype=dtype)
    padding = mx.array([width - n - 1 for n in lengths])
    mask = (mx.arange(width)[None, :] >= padding[:, None])[:, None, None, :]
    grouped = plan(queries, keys, keys, dims**-0.5, mask)
    if grouped is None:
        return False
    mx.eval(grouped)
    return True
