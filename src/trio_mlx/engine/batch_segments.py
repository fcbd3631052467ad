"""Rows of very different lengths in one decode batch, each group of like rows on a buffer of its
own. Runner thread only.

Why: mlx-lm's `BatchKVCache` keeps a layer's rows in one buffer as wide as the longest row. When a
long prompt joins a batch of short rows, every row is re-laid at the long row's width: on the
8B shape, 16 rows of ~300 positions joined by an 8,000-token one make 17 rows of ~9,000 positions,
64 buffers of 350 MB (22 GB, where the rows' own caches hold 2.3 GB), allocated in the join's step
and freed in the step after the long row leaves. On an H100 (`bench.long_arrival`, 16 streams)
those two steps stalled every stream: the join's 32-78 ms, the leave's 70-123 ms, against 9-11 ms
a step before; allocating the 64 buffers fresh took 58 ms and freeing them 55 ms, on their own.
The grouped attention (`ragged_attention`) spares the short rows the long row's width in every
step between, but not the buffers, nor the memory: two 32,000-token prompts among 16 short rows
would need 76 GB.

What: a joiner that would widen the batch's last group too much starts a group of its own
(`starts_group`): where the group's rows and the joiner are at least `MIN_WIDTH` wide and laying
them out together would hold more than `MAX_GROWTH` times the positions they hold apart. Each
layer of the batch's cache is then a `SegmentedKVCache`: its groups (`parts`, plain
`BatchKVCache` layers, each as `batch_layout` builds it, left-padded to its own longest row) in
row order. The model's forward pass sees one cache a layer, as before: every projection runs
once over all rows; `offset` is the rows' RoPE positions (the parts' in row order),
`update_and_fetch` writes each part's rows of the step into the part, `make_mask` gives each
part's own mask (`SegmentMasks`, the first layer's: the parts are alike in every layer, as a
plain batch's layers are), and the attention (`attend`, reached through the dispatcher,
`decode_attention.install_dispatcher`) runs per part over that part's buffer, the outputs
concatenated in row order. Every row attends over exactly the positions it did, with the same
arithmetic (a part's mask, or none where its rows are aligned: `batch_mask`).

So a long row joins with no re-layout of the others (its own cache becomes its part, on its own
buffers: `_new_part`), and leaves by dropping its part; the short rows'
part is filtered and extended on its own (`filter_rows`, `extend`), narrow; once the long row has
left, short parts on either side of it merge again. Where one part is left the layer is that
part again, a plain `BatchKVCache`, and everything that reads plain batch caches (the traced
batch step, the grouped attention) does so again; while the batch is segmented they step the
plain way (no trace, no grouping inside a part). Prompt chunks still
ride in the decode pass (`mixed_step`: its layer hands the rows' part of the pass to this one).

Measured (H100, 8B bf16, 16 streams, an 8,000-token prompt generating 64 tokens, three repeats
each way, docs/benchmarks "Long rows on buffers of their own"): the others' ITL p50 while the long
row decodes 18-20 ms against 18-23; without MLX's CUDA graphs the leave's stall 31-56 ms against
80-101 and the join's 28-45 against 35-61. With CUDA graphs neither stall moved: those steps'
time is MLX capturing graphs of a new topology on the host, which segments do not avoid.

Rows keep their order: joiners are appended, the last part taking those it can, new parts after
it; at most `MAX_PARTS` parts, after which the last takes every joiner. Used only where the
model's attention reaches the dispatcher (`supported`) and every layer is a plain key-value cache
(no rotating window, no recurrent state); elsewhere the batch lays out in one buffer as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine import batch_layout, batch_mask

#: A group narrower than this takes any joiner: a few padded columns cost less than a part.
MIN_WIDTH = 1024
#: A joiner starts its own group where the group and it laid out together would hold more than
#: this many times the positions they hold apart.
MAX_GROWTH = 1.5
#: The most groups a batch keeps; past them the last group takes every joiner.
MAX_PARTS = 4


@dataclass(frozen=True)
class SegmentMasks:
    """Each part's mask for one pass (what its `make_mask` gives: None, "causal" or an array),
    in row order."""

    parts: tuple[Any, ...]


class SegmentedKVCache:
    """One layer of a batch whose rows sit in several `BatchKVCache` parts (module docstring):
    `parts` in row order, `sizes` their row counts (host integers)."""

    def __init__(self, parts: list[Any]) -> None:
        if len(parts) < 2:
            raise ValueError("a segmented layer holds at least two parts")
        self.parts = parts
        self.sizes = [rows_of(p) for p in parts]
        #: the rows' RoPE positions, in row order (advanced by each pass, as the parts' are)
        self.offset = mx.concatenate([p.offset for p in parts])
        self._fetched: list[tuple[Any, Any]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> SegmentMasks:
        """Each part's mask for a pass of `N` tokens a row."""
        return SegmentMasks(
            tuple(p.make_mask(N, return_array=return_array, **kwargs) for p in self.parts)
        )

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Write each part's rows of the pass into the part; the parts' keys and values are kept
        for `attend`, and the pass's own are given back (the dispatcher hands them to `attend`,
        which does not read them)."""
        fetched = []
        start = 0
        for part, n in zip(self.parts, self.sizes, strict=True):
            stop = start + n
            fetched.append(part.update_and_fetch(keys[start:stop], values[start:stop]))
            start = stop
        self._fetched = fetched
        self.offset = self.offset + keys.shape[2]
        # Each part's offsets as views of the layer's, which the next pass's RoPE evaluates:
        # the parts' own (advanced by their `update_and_fetch`) are read by nothing until a row
        # leaves or joins, and would grow a chain of one addition a pass until then.
        start = 0
        for part, n in zip(self.parts, self.sizes, strict=True):
            part.offset = self.offset[start : start + n]
            start += n
        return keys, values

    def attend(self, queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        """The pass's attention, part by part over each part's buffer, in row order."""
        fetched, self._fetched = self._fetched, None
        if fetched is None or not isinstance(mask, SegmentMasks):
            raise RuntimeError("a segmented batch layer attends only after its update, masked")
        outputs = []
        start = 0
        for (part_keys, part_values), part_mask, n in zip(
            fetched, mask.parts, self.sizes, strict=True
        ):
            outputs.append(
                mx.fast.scaled_dot_product_attention(
                    queries[start : start + n],
                    part_keys,
                    part_values,
                    scale=scale,
                    mask=part_mask,
                )
            )
            start += n
        return mx.concatenate(outputs, axis=0)


def rows_of(part: Any) -> int:
    """A `BatchKVCache`'s row count (its offsets' length: known on the host)."""
    return int(part.offset.shape[0])


def supported(model: Any) -> bool:
    """Whether `model`'s attention reaches the dispatcher (the model modules the traced step
    knows), where `SegmentedKVCache.attend` runs; the dispatcher is installed by the caller."""
    from trio_mlx.engine.compiled_step import COMPILABLE_MODULES

    return type(model).__module__ in COMPILABLE_MODULES


def segmented(cache: Sequence[Any]) -> bool:
    """Whether a batch's cache is segmented (its layers `SegmentedKVCache`)."""
    return bool(cache) and type(cache[0]) is SegmentedKVCache


def starts_group(rows: int, width: int, length: int) -> bool:
    """Whether a joiner holding `length` positions starts a group of its own rather than join a
    group of `rows` rows `width` wide (module docstring)."""
    return _apart(rows, width, 1, length)


def _apart(rows: int, width: int, other_rows: int, other_width: int) -> bool:
    """Whether two groups (rows, width each) stay on buffers of their own: one of them at least
    `MIN_WIDTH` wide, and together they would hold more than `MAX_GROWTH` times the positions
    they hold apart."""
    if max(width, other_width) < MIN_WIDTH:
        return False
    together = (rows + other_rows) * max(width, other_width)
    apart = rows * width + other_rows * other_width
    return together > MAX_GROWTH * apart


def _plain(layers: Sequence[Any]) -> bool:
    return all(type(layer) is BatchKVCache for layer in layers)


def _parts(cache: Sequence[Any]) -> list[list[Any]]:
    """A batch's cache as its parts, each the list of its layers."""
    if segmented(cache):
        count = len(cache[0].parts)
        return [[layer.parts[p] for layer in cache] for p in range(count)]
    return [list(cache)]


def _assemble(cache: list[Any], parts: list[list[Any]]) -> None:
    """Write `parts` (each a list of layers) into `cache` in place: the part's layers where there
    is one, else a `SegmentedKVCache` a layer."""
    if len(parts) == 1:
        cache[:] = parts[0]
    else:
        cache[:] = [SegmentedKVCache([p[i] for p in parts]) for i in range(len(parts[0]))]


def _groups(
    lengths: Sequence[int | None], rows: int = 0, width: int = 0, parts: int = 1
) -> list[list[int]]:
    """Joiners of these lengths split into groups in order (indices), the first group joining a
    last part of `rows` rows `width` wide (none: `rows` 0), up to `MAX_PARTS` parts with the
    `parts` there are."""
    groups: list[list[int]] = [[]]
    for i, length in enumerate(lengths):
        n = length or 0
        if (rows or groups[-1]) and parts < MAX_PARTS and starts_group(rows, width, n):
            groups.append([])
            parts += 1
            rows, width = 0, 0
        groups[-1].append(i)
        rows, width = rows + 1, max(width, n)
    return groups


def _new_part(caches: list[list[Any]], lengths: list[int | None]) -> list[Any]:
    """A new part of these sequences' caches (`batch_layout.merged`), holding `lengths`
    positions each, with its `aligned` fact (`batch_mask`); one sequence on plain `KVCache`
    layers becomes a one-row part on its own buffers, not a copy of them: a long prompt's part
    is its prefill's cache, so its join neither copies nor allocates its keys and values again
    (~1 GB on the 8B at 8,000 positions)."""
    if len(caches) == 1 and all(type(c) is KVCache and c.keys is not None for c in caches[0]):
        part = [_adopted(layer) for layer in caches[0]]
    else:
        part = batch_layout.merged(caches)
    batch_mask.adopt(part, batch_mask.aligned_after_merge(lengths))
    return part


def _adopted(layer: Any) -> BatchKVCache:
    """One sequence's `KVCache` layer as a one-row `BatchKVCache` over the same buffers (the
    columns past its offset, room to grow in place, as in the sequence's own cache)."""
    length = int(layer.offset)
    part = BatchKVCache([0])
    part.keys, part.values = layer.keys, layer.values
    part.offset = mx.array([length])
    part._idx = length
    part.step = batch_layout.growth_step(length)  # an instance attribute over the class's 256
    return part


def merged(caches: list[list[Any]], lengths: Sequence[int | None]) -> list[Any] | None:
    """Sequences' caches merged into a new batch cache, in groups where their lengths call for
    it (a `SegmentedKVCache` a layer), or None where they make one group or are not all plain
    (`batch_layout.merged` then). `lengths`: each one's cached positions."""
    if not all(batch_layout.all_plain(c) for c in caches):
        return None
    groups = _groups(lengths)
    if len(groups) == 1:
        return None
    parts = [_new_part([caches[i] for i in g], [lengths[i] for i in g]) for g in groups]
    out: list[Any] = []
    _assemble(out, parts)
    return out


def extend(cache: list[Any], caches: list[list[Any]], lengths: Sequence[int | None]) -> bool:
    """The batch's cache (in place) with the sequences' caches appended as rows, the last part
    taking those it can and new parts the others; False (nothing done) where the batch is one
    group and stays one, or is not plain (`batch_layout.extend` then). `lengths`: each joiner's
    cached positions."""
    parts = _parts(cache)
    last = parts[-1]
    if not _plain(last) or not all(batch_layout.all_plain(c) for c in caches):
        return False
    groups = _groups(lengths, rows_of(last[0]), int(last[0]._idx), len(parts))
    if len(groups) == 1 and len(parts) == 1:
        return False
    if groups[0]:
        joining = [lengths[i] for i in groups[0]]
        aligned = batch_mask.aligned_after_extend(
            last, joining[0] if batch_mask.aligned_after_merge(joining) else None
        )
        batch_layout.extend(last, [caches[i] for i in groups[0]])
        batch_mask.adopt(last, aligned)
    for group in groups[1:]:
        parts.append(_new_part([caches[i] for i in group], [lengths[i] for i in group]))
    _assemble(cache, parts)
    return True


def filter_rows(cache: list[Any], keep: list[int], lengths: list[int]) -> None:
    """Keep the rows `keep` of a segmented batch's cache (in place); `lengths`: each kept row's
    cached positions, in order. A part left whole is untouched, one left empty goes, adjacent
    ones that one group would hold merge (`_coalesced`); where one part is left, the layers are
    its own again."""
    parts = _parts(cache)
    kept_parts: list[list[Any]] = []
    start = 0
    at = 0
    for part in parts:
        n = rows_of(part[0])
        local = [r - start for r in keep if start <= r < start + n]
        part_lengths = lengths[at : at + len(local)]
        at += len(local)
        start += n
        if not local:
            continue
        if len(local) < n or int(part[0]._idx) > max(part_lengths):
            aligned = batch_mask.aligned_after_filter(part, len(local))
            batch_layout.filter_rows(part, local, part_lengths)
            batch_mask.adopt(part, aligned)
        kept_parts.append(part)
    _assemble(cache, _coalesced(kept_parts))


def _coalesced(parts: list[list[Any]]) -> list[list[Any]]:
    """Adjacent parts merged where one group would hold them (`_apart`, the rule `starts_group`
    applies to a joiner: both narrow, or together at most `MAX_GROWTH` times apart): once a long
    row has left, the short groups before and after it step as one again (mlx-lm's `extend`,
    narrow)."""
    out = [parts[0]]
    for part in parts[1:]:
        last = out[-1]
        other_width = int(part[0]._idx)
        if _apart(rows_of(last[0]), int(last[0]._idx), rows_of(part[0]), other_width):
            out.append(part)
            continue
        aligned = batch_mask.aligned_after_extend(
            last, other_width if batch_mask.is_aligned(part) else None
        )
        for layer, other in zip(last, part, strict=True):
            layer.extend(other)
        batch_mask.adopt(last, aligned)
    return out


def locate(cache: Sequence[Any], row: int) -> tuple[list[Any], int]:
    """Row `row` of a segmented batch's cache: its part's layers and its index there."""
    for part in _parts(cache):
        n = rows_of(part[0])
        if row < n:
            return part, row
        row -= n
    raise IndexError("no such row in the batch")
