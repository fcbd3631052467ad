"""Several arrivals prefilled in one forward pass. Runs on the runner thread only, for
`batch_join.prefill` (`BatchDecoder.prefill`).

Sequences waiting to join the batch prefill on caches of their own (`BatchSequence`). When many
arrive together — a crowd of users, an agent's fan-out, a benchmark's burst — prefilling them one
pass each costs a pass each, and on a GPU a pass over a short prompt costs about what a decode
step costs (the device is launch-bound): 64 arrivals of 128 tokens were 64 passes before the
first of them could join. `prefill_together` puts the rest of every short prompt of a group
through the model in one pass:

- their caches (each restored from the prefix cache, or empty) are merged into one batch cache,
  left-padded to the longest cached prefix (mlx-lm's `KVCache.merge`), so that every row's next
  position is the same column and RoPE sees each row at its own offset;
- their remaining prompt tokens (all but the last: that one is the row's first decode input, as
  for any sequence joining) are right-padded to the longest and fed as one (B, L) batch; a row's
  real tokens never attend to its padding (it comes after them, and attention is causal), and
  the padding's keys are cut off below;
- each row's cache is then copied back out of the batch cache as a plain `KVCache` holding
  exactly its prefix and its prompt (the `BatchSequence` joins the decode batch as usual, and its
  store points' snapshots are taken from that cache).

With `bucketed` (the decoder's recurring shapes on MLX's CUDA backend, `prefill_shapes`), the
pass's shape is taken from a few: its width is the smallest rung of the chunk ladder that holds
the longest rest, and its rows are padded to a power of two with copies of the last sequence's
row (cache and tokens; their results are dropped), so that a burst's group passes recur in a
few (rows, tokens) shapes whose attention graphs cuDNN builds once, not one per group.

Where every cached prefix has one length the pass needs no array mask (rows are aligned: the
plain causal mask), else mlx-lm's left-padding mask. Only plain `KVCache` layers are grouped: a
rotating, quantized or recurrent cache (whose state would take the padding in) prefills alone.
Each row's result is the model's for that row alone: the same products row by row, its own
positions, only its own keys visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from trio_mlx.engine import batch_layout, batch_mask
from trio_mlx.engine.prefill_shapes import chunk_ladder

if TYPE_CHECKING:
    from trio_mlx.engine.batch_sequence import BatchSequence

#: a group's padded tokens (rows x longest) may be at most this many times its real tokens
MAX_PADDING_FACTOR = 2.0


def groupable(seq: BatchSequence) -> bool:
    """Whether `seq` can prefill in a group: its prompt goes through the model itself (not a
    prompt with media's embeddings, nor a SpecPrefill row's scoring and sparse prefill) and every
    layer of its cache is a plain `KVCache`."""
    return (
        seq.prefill_model is None
        and not seq.sparse
        and seq.cache is not None
        and all(type(layer) is KVCache for layer in seq.cache)
    )


def can_group(seq: BatchSequence, step: int) -> bool:
    """Whether `seq` could take part in a group now: groupable, and its prefill finishes in one
    pass (between 1 and `step` tokens left)."""
    return 0 < seq.remaining_prompt() <= step and groupable(seq)


#: A sequence that could be grouped: its place in `waiting`, itself, its rest's tokens.
_Candidate = tuple[int, "BatchSequence", int]


def choose_group(
    waiting: Sequence[BatchSequence], tokens: int, step: int, block: int
) -> list[BatchSequence]:
    """The sequences of `waiting` to prefill together in one pass (in admission order): each
    finishes its prefill there (at most `step` tokens left), their real tokens add up to at most
    `tokens`, and the padded batch (rows x longest, in whole `block`s) stays within
    `MAX_PADDING_FACTOR` of them. The group holds the oldest sequence that could take part (else
    there is none), so that newer arrivals grouped first never leave it waiting: the budget's
    tokens and seconds left after a group go to a chunk each in admission order
    (`batch_join.prefill`), and a group of newer ones could take them all, round after round.
    Of the groups that qualify, the one with the most real tokens: for each width a rest may
    set, the sequences that fit it, the longest rests first (room kept in the budget for the
    oldest), so that a short rest at the head of `waiting` (a prompt's last piece after its
    chunks) rides with the longer ones instead of keeping them out; and the oldest first, then
    the longest, where the padding would keep the oldest out of a group of a few rows. Fewer
    than two: none (one prefills alone as usual)."""
    candidates = [
        (i, seq, seq.remaining_prompt()) for i, seq in enumerate(waiting) if can_group(seq, step)
    ]
    if not candidates:
        return []
    oldest = candidates[0]
    by_length = sorted(candidates, key=lambda c: (-c[2], c[0]))
    orders = (by_length, [oldest, *(c for c in by_length if c is not oldest)])
    best: list[_Candidate] = []
    most = 0
    for width in sorted({_whole_blocks(left, block) for _, _, left in candidates}):
        if width < _whole_blocks(oldest[2], block):
            continue
        for order in orders:
            group = _filled(order, oldest, width, tokens, block)
            real = sum(left for _, _, left in group)
            if len(group) >= 2 and real > most:
                best, most = group, real
    return [seq for _, seq, _ in sorted(best, key=lambda c: c[0])]


def _filled(
    order: Sequence[_Candidate], oldest: _Candidate, width: int, tokens: int, block: int
) -> list[_Candidate]:
    """A group of width `width` (in whole `block`s), taken greedily in `order`: the rests that
    fit the width, within `tokens` (room kept for `oldest`'s rest until it is in) and the
    padding bound; empty unless `oldest` is in it."""
    group: list[_Candidate] = []
    real = 0
    held = False  # whether the oldest is in the group yet (else its rest is kept free)
    for entry in order:
        left = entry[2]
        kept = 0 if held or entry is oldest else oldest[2]
        if _whole_blocks(left, block) > width or real + left + kept > tokens:
            continue
        if group and (len(group) + 1) * width > MAX_PADDING_FACTOR * (real + left):
            continue
        group.append(entry)
        real += left
        held = held or entry is oldest
    return group if held else []


def prefill_together(
    model: Any, group: Sequence[BatchSequence], block: int, *, bucketed_up_to: int | None = None
) -> list[tuple[int, tuple[int, ...]]]:
    """Prefill the rest of every prompt of `group` but its last token in one forward pass, each
    row's cache left holding exactly its prefix and its prompt (module docstring); return each
    sequence's tokens prefilled and store points reached. With `bucketed_up_to` (the plan's
    step), the pass's shape is bucketed (module docstring). Raises whatever the model raises,
    before any sequence changes."""
    caches: list[list[Any]] = []
    for seq in group:
        assert seq.cache is not None
        caches.append(seq.cache)
    cached = [int(c[0].offset) for c in caches]
    lefts = [seq.remaining_prompt() for seq in group]
    width = _whole_blocks(max(lefts), block)
    spare = 0
    if bucketed_up_to is not None:
        width = min((r for r in chunk_ladder(block, bucketed_up_to) if r >= width), default=width)
        spare = (1 << (len(group) - 1).bit_length()) - len(group)
    rows = []
    for seq, n in zip(group, lefts, strict=True):
        tokens = seq.job.prompt_tokens[seq.prompt_done : seq.prompt_done + n]
        rows.append(list(tokens) + [tokens[-1]] * (width - n))
    rows += [rows[-1]] * spare
    caches += [caches[-1]] * spare
    cached += [cached[-1]] * spare
    batch = batch_layout.merged(caches)
    batch_mask.adopt(batch, batch_mask.aligned_after_merge(list(cached)))
    model(mx.array(rows, dtype=mx.uint32), cache=batch)
    longest = max(cached)
    own: list[list[KVCache]] = []
    for row, (before, n) in enumerate(zip(cached[: len(group)], lefts, strict=True)):
        start = longest - before  # the row's left padding
        own.append([_row_cache(layer, row, start, longest + n) for layer in batch])
    mx.eval([c.state for cache in own for c in cache])
    done = []
    for seq, cache, n in zip(group, own, lefts, strict=True):
        seq.cache = cache
        done.append((n, seq.advance(n)))
    return done


def _row_cache(layer: Any, row: int, start: int, end: int) -> KVCache:
    """Row `row`'s positions `start:end` of a batch cache layer, as a plain `KVCache`."""
    cache = KVCache()
    cache.keys = mx.contiguous(layer.keys[row : row + 1, :, start:end])
    cache.values = mx.contiguous(layer.values[row : row + 1, :, start:end])
    cache.offset = end - start
    return cache


def _whole_blocks(n: int, block: int) -> int:
    return -(-n // block) * block
