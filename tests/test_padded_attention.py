"""`padded_attention.padded_forward`: a multi-token pass attending over the cache's whole buffer
(the CUDA backend's cuDNN graphs then depend on the buffer's size only) computes what the plain
pass computes and leaves the cache as the plain pass does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from trio_mlx.engine.loading import load_model
from trio_mlx.engine.padded_attention import padded_forward
from trio_mlx.engine.prompt_cache import make_cache


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    return load_model(tiny_model_dir).model


def prefilled(model: Any, length: int) -> list[Any]:
    cache = make_cache(model)
    model(mx.arange(3, 3 + length)[None].astype(mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("length", [7, 254, 300])  # within a buffer, growing across 256, past
def test_a_padded_pass_equals_the_plain_one(model: Any, length: int) -> None:
    tokens = mx.array([[11, 12, 13, 14, 15]], dtype=mx.uint32)
    plain_cache, padded_cache = prefilled(model, length), prefilled(model, length)
    plain = model(tokens, cache=plain_cache)
    padded = padded_forward(model, tokens, padded_cache)
    assert mx.allclose(plain, padded, atol=1e-4).item()
    assert [c.offset for c in padded_cache] == [c.offset for c in plain_cache]
    # Cut back as after a refused draft, then carry on: still the same.
    for cache in (plain_cache, padded_cache):
        for layer in cache:
            layer.trim(3)
    nxt = mx.array([[21, 22, 23]], dtype=mx.uint32)
    assert mx.allclose(
        model(nxt, cache=plain_cache), padded_forward(model, nxt, padded_cache), atol=1e-4
    ).item()


def test_a_padded_pass_over_a_batch_cache_masks_each_rows_left_padding(model: Any) -> None:
    rows = [prefilled(model, 9), prefilled(model, 40)]
    merged = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    again = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    tokens = mx.array([[5, 6, 7], [8, 9, 10]], dtype=mx.uint32)
    plain = model(tokens, cache=merged)
    padded = padded_forward(model, tokens, again)
    assert mx.allclose(plain, padded, atol=1e-4).item()
