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


def test_through_the_dispatcher_the_views_attention_is_the_plain_one(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the attention dispatcher is installed (the batched route), a padded pass attends
    through its views' own `attend` (row-contiguous queries, the layout whose cuDNN graphs are
    warmed): still the plain pass's logits and cache."""
    from trio_mlx.engine import padded_attention
    from trio_mlx.engine.compiled_step import COMPILABLE_MODULES
    from trio_mlx.engine.decode_attention import install_dispatcher

    install_dispatcher(COMPILABLE_MODULES)
    calls = []
    attend = padded_attention._PaddedView.attend

    def counted(self: Any, *args: Any) -> Any:
        calls.append(args[0].shape)
        return attend(self, *args)

    monkeypatch.setattr(padded_attention._PaddedView, "attend", counted)
    tokens = mx.array([[11, 12, 13, 14, 15]], dtype=mx.uint32)
    plain_cache, padded_cache = prefilled(model, 30), prefilled(model, 30)
    plain = model(tokens, cache=plain_cache)
    padded = padded_forward(model, tokens, padded_cache)
    assert len(calls) == len(padded_cache) and all(shape[2] == 5 for shape in calls)
    assert mx.allclose(plain, padded, atol=1e-4).item()
    nxt = mx.array([[21, 22]], dtype=mx.uint32)
    assert mx.allclose(
        model(nxt, cache=plain_cache), padded_forward(model, nxt, padded_cache), atol=1e-4
    ).item()
