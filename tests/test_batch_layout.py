"""Rows joining the batch cache in one buffer with room to grow (`engine/batch_layout.py`): the
same cached positions, offsets and left padding as mlx-lm's own `merge` / `extend`, room left so
that the next steps write in place, the growth step an eighth of the length; and the engine's
tokens unchanged when a long prompt joins a batch of short rows (tiny fp32 model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import BatchKVCache, KVCache

import trio_mlx
from servers import eventually
from trio_mlx.engine import batch_layout

HEADS, DIMS = 2, 4


def filled(n: int, seed: int) -> KVCache:
    cache = KVCache()
    if n:
        keys = mx.random.normal((1, HEADS, n, DIMS), key=mx.random.key(seed))
        cache.update_and_fetch(keys, keys * 2 + 1)
    return cache


def visible(layer: Any) -> list[list[Any]]:
    """Each row's cached keys and values (its padding left out), as lists."""
    keys, values = layer.keys_and_values()
    padding = layer.left_padding.tolist()
    return [
        [keys[r, :, padding[r] :].tolist(), values[r, :, padding[r] :].tolist()]
        for r in range(keys.shape[0])
    ]


def state(layer: Any) -> tuple[Any, ...]:
    return (layer._idx, layer.offset.tolist(), layer.left_padding.tolist(), visible(layer))


@pytest.mark.parametrize("lengths", [[5, 5], [3, 9, 1], [0, 4], [300, 2]])
def test_merged_holds_what_mlx_lms_merge_holds(lengths: list[int]) -> None:
    rows = [filled(n, i) for i, n in enumerate(lengths)]
    ours = batch_layout.merged([[row] for row in rows])[0]
    theirs = KVCache.merge(rows)
    assert type(ours) is BatchKVCache
    assert state(ours) == state(theirs)
    assert ours.keys.shape[2] >= ours._idx + batch_layout.MIN_STEP


@pytest.mark.parametrize(
    ("batch_lengths", "joining"), [([6, 2], [40]), ([40, 3], [5, 1]), ([4], [4]), ([7], [0])]
)
def test_extend_holds_what_mlx_lms_extend_holds(
    batch_lengths: list[int], joining: list[int]
) -> None:
    def batch() -> BatchKVCache:
        cache = KVCache.merge([filled(n, 10 + i) for i, n in enumerate(batch_lengths)])
        step = mx.random.normal((len(batch_lengths), HEADS, 1, DIMS), key=mx.random.key(3))
        cache.update_and_fetch(step, step)  # a decode step: rows at their own offsets
        return cache

    joiners = [filled(n, 20 + i) for i, n in enumerate(joining)]
    ours, theirs = batch(), batch()
    batch_layout.extend([ours], [[j] for j in joiners])
    theirs.extend(KVCache.merge(joiners))
    assert state(ours) == state(theirs)
    # room for the next steps: they write in place, no growth
    size = ours.keys.shape[2]
    assert size >= ours._idx + batch_layout.MIN_STEP
    step = mx.zeros((len(batch_lengths) + len(joining), HEADS, 1, DIMS))
    for _ in range(3):
        ours.update_and_fetch(step, step)
        theirs.update_and_fetch(step, step)
    assert ours.keys.shape[2] == size
    assert state(ours) == state(theirs)


def test_growth_step_is_an_eighth_in_whole_steps() -> None:
    assert batch_layout.growth_step(10) == 256
    assert batch_layout.growth_step(2048) == 256
    assert batch_layout.growth_step(8000) == 1024
    assert batch_layout.growth_step(8200) == 1280
    long = batch_layout.merged([[filled(8000, 1)], [filled(3, 2)]])[0]
    assert long.step == 1024 and long.keys.shape[2] == 8000 + 1024


async def test_a_long_prompt_joining_short_rows_keeps_every_rows_tokens(
    tiny_model_dir: Path,
) -> None:
    """Short requests decoding, then a long one joins (its cache longer than the batch's): every
    request's greedy tokens are what it gives alone."""
    short = [f"Short request number {i}." for i in range(3)]
    long = " ".join(["The lighthouse keeper watched the grey sea roll."] * 20)
    greedy: dict[str, Any] = {"max_tokens": 24, "temperature": 0.0}
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        alone = [(await engine.generate(p, **greedy)).tokens for p in [*short, long]]
    together: dict[int, list[int]] = {}
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=8) as engine:

        async def one(i: int, prompt: str) -> None:
            together[i] = (await engine.generate(prompt, **greedy)).tokens

        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(short):
                nursery.start_soon(one, i, prompt)
            await eventually(lambda: engine.get_stats()["runner"]["decode_steps"] >= 3)
            nursery.start_soon(one, len(short), long)
    assert [together[i] for i in range(len(short) + 1)] == alone


@pytest.mark.parametrize("keep", [[0, 2], [1], [2, 3], [0, 1, 2, 3]])
def test_rows_leave_as_mlx_lms_filter_leaves_them(keep: list[int]) -> None:
    lengths = [5, 30, 12, 7]

    def batch() -> BatchKVCache:
        cache = batch_layout.merged([[filled(n, 40 + i)] for i, n in enumerate(lengths)])[0]
        step = mx.random.normal((len(lengths), HEADS, 1, DIMS), key=mx.random.key(5))
        cache.update_and_fetch(step, step)
        return cache

    ours, theirs = batch(), batch()
    batch_layout.filter_rows([ours], keep, [lengths[i] + 1 for i in keep])
    theirs.filter(keep)
    assert state(ours) == state(theirs)


@pytest.mark.parametrize("row", [0, 1, 3])
def test_a_row_copied_out_holds_what_mlx_lms_extract_gives(row: int) -> None:
    lengths = [5, 30, 12, 7]
    cache = batch_layout.merged([[filled(n, 60 + i)] for i, n in enumerate(lengths)])[0]
    step = mx.random.normal((len(lengths), HEADS, 1, DIMS), key=mx.random.key(6))
    cache.update_and_fetch(step, step)
    ours = batch_layout.extract_row([cache], row, lengths[row] + 1)[0]
    theirs = cache.extract(row)
    assert ours.offset == theirs.offset == lengths[row] + 1
    assert ours.keys.tolist() == theirs.keys.tolist()
    assert ours.values.tolist() == theirs.values.tolist()
