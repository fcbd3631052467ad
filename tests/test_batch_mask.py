"""The batch's attention mask (`engine/batch_mask.py`): no array mask where no row is padded (a
lone row, rows of one length), mlx-lm's array mask where rows are padded, and the same tokens as
the serialized route either way (tiny fp32 model)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import BatchKVCache, KVCache

import trio_mlx
from trio_mlx.engine import batch_mask, padded_attention
from trio_mlx.engine.batch import BatchDecoder

GREEDY = {"max_tokens": 12, "temperature": 0.0}
SHORT = "Hello there"
LONG = "The quick brown fox jumps over the lazy dog because it was late for dinner"


class MaskLog:
    """Records what every batch mask of a one-token step was: None or an array."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kinds: list[str] = []
        original = batch_mask.aligned_make_mask

        def logged(cache: Any, N: int, *args: Any, **kwargs: Any) -> Any:
            mask = original(cache, N, *args, **kwargs)
            if N == 1:
                self.kinds.append("none" if mask is None else "array")
            return mask

        monkeypatch.setattr(batch_mask, "aligned_make_mask", logged)


def filled(n: int) -> KVCache:
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
    return cache


def test_alignment_follows_merge_extend_and_filter() -> None:
    equal = [filled(5), filled(5)]
    batch = [KVCache.merge(equal)]
    batch_mask.adopt(batch, batch_mask.aligned_after_merge([5, 5]))
    assert batch_mask.is_aligned(batch)
    assert type(batch[0]) is BatchKVCache  # still mlx-lm's class: padded verification takes it
    assert padded_attention._views(batch, 3) is not None
    assert batch[0].make_mask(1) is None and batch[0].make_mask(3) == "causal"
    # A row of another length joins: padded, mlx-lm's array mask again.
    assert not batch_mask.aligned_after_extend(batch, 7)
    assert batch_mask.aligned_after_extend(batch, 5)
    other = KVCache.merge([filled(7)])
    aligned = batch_mask.aligned_after_extend(batch, 7)
    batch[0].extend(other)
    batch_mask.adopt(batch, aligned)
    mask = batch[0].make_mask(1)
    assert isinstance(mask, mx.array)
    # 7 cached positions and the step's own: the two short rows' first 2 are padding.
    assert mask[:, 0, 0, :].tolist() == [[False, False] + [True] * 6] * 2 + [[True] * 8]
    # Down to one row: aligned whatever the padding was (filter shifts it away).
    aligned = batch_mask.aligned_after_filter(batch, 1)
    batch[0].filter([0])
    batch_mask.adopt(batch, aligned)
    assert batch[0].make_mask(1) is None
    assert batch_mask.aligned_after_merge([4, 6]) is False
    assert batch_mask.aligned_after_merge([None]) is False


def test_an_adopted_layer_is_freed_by_reference_counting() -> None:
    # Its mask once was a method bound to the layer in the layer's own __dict__: a reference
    # cycle, so a batch's keys and values stayed alive until the cyclic collector ran (found as
    # MB of MLX arrays left after the batched route's abandonment storm).
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    gc.disable()
    try:
        batch = [KVCache.merge([filled(300), filled(200)])]
        batch_mask.adopt(batch, batch_mask.aligned_after_merge([300, 200]))
        mx.eval(batch[0].make_mask(1))
        gone = weakref.ref(batch[0])
        assert mx.get_active_memory() > before
        del batch
        assert gone() is None
        assert mx.get_active_memory() <= before
    finally:
        gc.enable()


class CacheLog:
    """Records the kind of cache every decode step of the batch ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kinds: list[str] = []
        original = BatchDecoder._queue_step

        def logged(decoder: BatchDecoder, *args: Any) -> Any:
            self.kinds.append(type(decoder._cache[0]).__name__)
            return original(decoder, *args)

        monkeypatch.setattr(BatchDecoder, "_queue_step", logged)


async def test_a_lone_row_decodes_on_its_own_cache_and_gives_the_serialized_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        expected = [(await engine.generate(p, **GREEDY)).tokens for p in (SHORT, LONG)]
    masks, caches = MaskLog(monkeypatch), CacheLog(monkeypatch)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        alone = (await engine.generate(SHORT, **GREEDY)).tokens
        assert engine.get_stats()["runner"]["batching"] is True
        assert alone == expected[0]
        # The serialized route's cache and step: no batch cache, no batch mask.
        assert caches.kinds and set(caches.kinds) == {"KVCache"}
        assert masks.kinds == []
        caches.kinds.clear()
        # Two rows of different lengths: padded, masked; the short one finishes first (fewer
        # tokens), and the long one goes on alone, on its own cache again.
        outputs: list[Any] = [None, None]

        async def one(i: int, prompt: str, max_tokens: int) -> None:
            out = await engine.generate(prompt, max_tokens=max_tokens, temperature=0.0)
            outputs[i] = out.tokens

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, SHORT, 4)
            nursery.start_soon(one, 1, LONG, GREEDY["max_tokens"])
    assert outputs == [expected[0][:4], expected[1]]
    if "BatchKVCache" in caches.kinds:  # they overlapped: masked while padded, then alone
        assert "array" in masks.kinds
        assert caches.kinds[-1] == "KVCache"


async def test_a_lone_row_in_a_batch_cache_decodes_without_a_mask(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `solo_rows` off a lone row stays in the batch cache: aligned, no array mask."""
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        expected = (await engine.generate(LONG, **GREEDY)).tokens
    masks, caches = MaskLog(monkeypatch), CacheLog(monkeypatch)
    monkeypatch.setattr(BatchDecoder, "solo_rows", False)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        alone = (await engine.generate(LONG, **GREEDY)).tokens
    assert alone == expected
    assert set(caches.kinds) == {"BatchKVCache"}
    assert masks.kinds and set(masks.kinds) == {"none"}
