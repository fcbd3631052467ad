"""The batch cache's buffers when rows join it: one allocation, room to grow. Runner thread only.

mlx-lm's `BatchKVCache` keeps a layer's rows in one buffer, left-padded to one write position
(`_idx`). Rows joining a batch through its `extend` cost three buffers of every row at the longest
row's length, written in one step: the batch's buffer padded to the longer side, the two sides
concatenated, and, since neither that nor `merge` leaves a free column, the next decode step's
`update_and_fetch` growing it by concatenation. When a long prompt joins a batch of short rows
that is 3 x 18 GB on the 8B shape (17 rows at 8,000 positions, 32 layers), read and written in the
join's step, which stalls every running stream for that step (issue 16's ITL p99 while an
8k-token prompt is admitted). mlx-lm also grows a buffer by 256 columns at a time, each growth a
copy of the whole buffer: every 256 steps for a batch of long rows.

Here rows join a plain `BatchKVCache` layer (from plain `KVCache` layers: what a prefilled
sequence holds) in one new buffer per layer: zeros of (rows, heads, columns, dims), each row's
cached positions written at their place (the batch's rows as they are, each joiner's
right-aligned to the write position), with `columns` the write position plus a growth step; and
the layer's growth step (`step`, which `update_and_fetch` reads) becomes an eighth of its length
(`growth_step`, at least mlx-lm's 256), so the following steps write in place and growing copies
the buffer rarely, at most an eighth of it idle. The layers built are mlx-lm's `BatchKVCache` in
the state its `merge` / `extend` leave (left padding, per-row offsets, `_idx`), so all else reads
them as before. Layers of other classes (rotating windows, recurrent state) keep their classes'
`merge` / `extend`. A SpecPrefill row's layers (`true_positions.PositionedKVCache`: the kept tokens
of a long prompt, each at its true position) join as plain ones, except that the row's `offset` (the
RoPE position mlx-lm's batch cache keeps per row) is its true next position, past what it stores;
its write index and left padding (what the mask reads) follow what it stores, and `extract_row`
gives it back a `PositionedKVCache` from its shift (`BatchSequence.position_shift`).

Rows leave (`filter_rows`) as by mlx-lm's `filter` (the kept rows gathered, the columns every kept
row has as padding cut from the left), except that how many columns that is comes from the host
(`shift`: the batch's write position less the longest kept row's cached length, which the
decoder knows), where mlx-lm's reads the left padding back from the device: a wait for the step
in flight, so the host could not build the next step while the device ran it, once for every
request that finished (2.4-2.8 ms a finish on the tiny model on this CPU, about a whole step).
A row's own cache is copied out (`extract_row`: a finished row's, for its snapshot; the last row
left, to decode alone) the same way, from the row's length on the host where mlx-lm's `extract`
reads its left padding back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine.true_positions import PositionedKVCache, positioned_cache, stored_length

#: mlx-lm's growth step of a `BatchKVCache` (its class attribute `step`)
MIN_STEP = 256


def batchable(cache: Sequence[Any]) -> bool:
    """Whether every layer of a prompt cache can be merged into a batch (`merge`/`extend`)."""
    return all(hasattr(c, "merge") for c in cache)


def growth_step(columns: int) -> int:
    """The growth step for a buffer of `columns` used columns: an eighth of them, rounded up to a
    multiple of `MIN_STEP` (at least `MIN_STEP`)."""
    eighth = max(columns // 8, 1)
    return max(MIN_STEP, -(-eighth // MIN_STEP) * MIN_STEP)


def merged(caches: list[list[Any]]) -> list[Any]:
    """Sequences' caches (each a list of layers, in row order) merged layer by layer into one
    batch cache, rows left-padded to the longest (module docstring)."""
    out = []
    for i in range(len(caches[0])):
        layers = [c[i] for c in caches]
        joined = _joined(None, layers) if all_plain(layers) else None
        out.append(joined if joined is not None else layers[0].merge(layers))
    return out


def extend(batch: list[Any], caches: list[list[Any]]) -> None:
    """The batch's cache (its layers, in place) with the sequences' caches appended as rows, in
    order (module docstring)."""
    for i, layer in enumerate(batch):
        layers = [c[i] for c in caches]
        plain = type(layer) is BatchKVCache and all_plain(layers)
        if not plain or _joined(layer, layers) is None:
            layer.extend(layers[0].merge(layers))


def all_plain(layers: list[Any]) -> bool:
    """Plain `KVCache` layers, or a SpecPrefill row's `PositionedKVCache` ones."""
    return all(type(layer) in (KVCache, PositionedKVCache) for layer in layers)


def _joined(batch: Any, rows: list[Any]) -> Any:
    """`batch`'s rows (None: a new batch) and `rows` in one new buffer, written into `batch`
    (or a new `BatchKVCache`); None where there is nothing to lay out (every side empty), for
    the classes' own methods."""
    sides = [] if batch is None or batch.keys is None else [(batch.keys, batch.values)]
    lengths = [stored_length(row) for row in rows]  # the write index's (and the mask's)
    positions = [int(row.offset) for row in rows]  # RoPE's: past `lengths` on a sparse row
    sides += [
        (row.keys, row.values)
        for row, n in zip(rows, lengths, strict=True)
        if row.keys is not None and n > 0
    ]
    if not sides or (batch is not None and batch.keys is None):
        return None
    template_keys, template_values = sides[0]
    idx = max([batch._idx if batch is not None else 0, *lengths])
    columns = idx + growth_step(idx)
    kept = 0 if batch is None else int(batch.keys.shape[0])
    count = kept + len(rows)
    _, heads, _, key_dims = template_keys.shape
    value_dims = template_values.shape[3]
    keys = mx.zeros((count, heads, columns, key_dims), dtype=template_keys.dtype)
    values = mx.zeros((count, heads, columns, value_dims), dtype=template_values.dtype)
    padding: list[Any] = []
    offsets: list[Any] = []
    if batch is not None:
        shift = idx - batch._idx
        keys[:kept, :, shift:idx] = batch.keys[..., : batch._idx, :]
        values[:kept, :, shift:idx] = batch.values[..., : batch._idx, :]
        padding.append(batch.left_padding + shift)
        offsets.append(batch.offset)
    for r, (row, length) in enumerate(zip(rows, lengths, strict=True), start=kept):
        if length > 0:
            keys[r : r + 1, :, idx - length : idx] = row.keys[..., :length, :]
            values[r : r + 1, :, idx - length : idx] = row.values[..., :length, :]
    padding.append(mx.array([idx - n for n in lengths]))
    offsets.append(mx.array(positions))
    target = batch if batch is not None else BatchKVCache([0] * count)
    target.keys, target.values = keys, values
    target.left_padding = mx.concatenate(padding)
    target.offset = mx.concatenate(offsets)
    target._idx = idx
    target.step = growth_step(idx)  # an instance attribute over the class's 256
    return target


def filter_rows(layers: list[Any], keep: list[int], lengths: list[int]) -> None:
    """Keep the rows `keep` of a batch's cache (in place, module docstring); `lengths`: each kept
    row's cached positions, in order. Plain `BatchKVCache` layers without reading the device;
    others by their class's `filter`."""
    for layer in layers:
        if type(layer) is not BatchKVCache:
            layer.filter(keep)
            continue
        rows = mx.array(keep)
        if layer.keys is not None:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        layer.offset = layer.offset[rows]
        layer.left_padding = layer.left_padding[rows]
        shift = layer._idx - max(lengths)
        if shift > 0:
            if layer.keys is not None:
                layer.keys = layer.keys[..., shift:, :]
                layer.values = layer.values[..., shift:, :]
            layer._idx -= shift
            layer.left_padding = layer.left_padding - shift


def extract_row(layers: list[Any], row: int, length: int, shift: int = 0) -> list[Any]:
    """Row `row` of a batch's cache as a sequence's own cache (a copy); `length`: its cached
    positions; `shift`: how far past them its next position is (a SpecPrefill row's skipped
    prompt tokens: its own cache is then a `PositionedKVCache`, whose `offset` keeps its true
    position). Plain `BatchKVCache` layers without reading the device; others by their class's
    `extract`."""
    out = []
    for layer in layers:
        if type(layer) is not BatchKVCache:
            out.append(layer.extract(row))
            continue
        keys: Any = layer.keys  # mlx-lm declares them None until filled
        values: Any = layer.values
        start = layer._idx - length
        row_keys = mx.contiguous(keys[row : row + 1, :, start : layer._idx])
        row_values = mx.contiguous(values[row : row + 1, :, start : layer._idx])
        if shift:
            out.append(positioned_cache(row_keys, row_values, length, shift))
            continue
        cache = KVCache()
        cache.keys, cache.values = row_keys, row_values
        cache.offset = length
        out.append(cache)
    return out
