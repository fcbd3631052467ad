"""Rows on their way out of the decode batch: finished, aborted or failed. Runs on the runner
thread only, for `BatchDecoder` (the mirror of `batch_join`).

A row leaves in two moves. When it ends (a finish read, `BatchDecoder.remove`) it is marked
`removed`, and a finished row, or an aborted one whose cache is kept, has its cache taken out of
the batch's for its snapshot (`row_cache`: a lone row's own cache as it is, else a copy of its
row, `batch_layout.extract_row`); the step already queued still computes its row. At the next
step the removed rows leave the batch's cache (`left`) before it queues its forward pass:
- none left: the batch is empty;
- one left, with solo rows: it goes on with a cache of its own (`BatchDecoder.solo`: its step is
  the serialized route's forward pass), one copy of its keys and values;
- else the kept rows are filtered out of the batch cache in place (`batch_layout.filter_rows`),
  keeping its `aligned` fact (`batch_mask`) from what the host knows; a segmented batch's parts
  each on their own, a part left empty dropped (`batch_segments.filter_rows`).

The batched forward pass raising (or its evaluation) fails every row in it, the only requests it
can be attributed to (`failed`); the decoder then starts again empty.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from trio_mlx.engine import batch_layout, batch_mask, batch_segments
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.batch_step import RowResult


def row_cache(rows: list[BatchSequence], cache: list[Any], row: int, *, solo: bool) -> list[Any]:
    """Row `row`'s cache: the lone row's own (`solo`, no copy) or a copy out of the batch's
    `cache`."""
    if solo:
        return cache
    seq = rows[row]
    if batch_segments.segmented(cache):
        cache, row = batch_segments.locate(cache, row)
    return batch_layout.extract_row(cache, row, seq.cached_length, seq.position_shift)


def left(
    rows: list[BatchSequence], cache: list[Any], inputs: Any, *, solo: bool, solo_rows: bool
) -> tuple[list[BatchSequence], list[Any], Any, bool]:
    """The batch once its removed rows have left (module docstring): its rows, its cache, the
    next step's inputs (one a row, lazy) and whether its lone row is on its own cache. `cache`
    is filtered in place where the kept rows stay in it; `rows` is not changed."""
    keep = [i for i, seq in enumerate(rows) if not seq.removed]
    if len(keep) == len(rows):
        return rows, cache, inputs, solo
    if not keep:
        return [], [], None, False
    if len(keep) == 1 and solo_rows:
        # One row left: it goes on with a cache of its own (`BatchDecoder.solo`).
        own = row_cache(rows, cache, keep[0], solo=solo)
        return [rows[keep[0]]], own, inputs[keep[0] : keep[0] + 1], True
    lengths = [rows[i].cached_length for i in keep]
    if batch_segments.segmented(cache):
        batch_segments.filter_rows(cache, keep, lengths)  # each part keeps its own facts
    else:
        aligned = batch_mask.aligned_after_filter(cache, len(keep))
        batch_layout.filter_rows(cache, keep, lengths)
        batch_mask.adopt(cache, aligned)
    return [rows[i] for i in keep], cache, inputs[mx.array(keep)], solo


def failed(rows: list[BatchSequence], exc: Exception) -> list[RowResult]:
    """Fail every live row of `rows` with `exc` (the batch's forward pass or its evaluation
    raised): each is marked `removed` and gets an error result."""
    error = f"{type(exc).__name__}: {exc}"
    live = [s for s in rows if not s.removed]
    for seq in live:
        seq.removed = True
    return [RowResult(seq, finish="error", error=error) for seq in live]
