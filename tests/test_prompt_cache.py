"""`max_kv_size` really bounds the KV cache, also for models with their own `make_cache` (mlx-lm's
llama, whose `make_prompt_cache(model, max_kv_size)` ignores the bound), and prefix caching stays
exact under the bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import llama as llama_module
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

import trio_mlx
from tiny_model import TINY_CONFIG
from trio_mlx.engine.prompt_cache import KEEP_TOKENS, chunking_exact_limit, make_cache

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(str(tiny_model_dir))[:2]
    return model, tokenizer


def test_mlx_lm_ignores_max_kv_size_for_llama_and_make_cache_applies_it(
    loaded: tuple[Any, Any],
) -> None:
    model, _ = loaded
    # The reason this module exists: llama has its own make_cache, so the bound is dropped.
    assert [type(c) for c in make_prompt_cache(model, max_kv_size=16)] == [KVCache, KVCache]
    assert [type(c) for c in make_cache(model)] == [KVCache, KVCache]
    bounded = make_cache(model, 16)
    assert all(type(c) is RotatingKVCache for c in bounded)
    assert [(c.max_size, c.keep) for c in bounded] == [(16, KEEP_TOKENS)] * 2
    assert chunking_exact_limit(bounded) == 16
    assert chunking_exact_limit(make_cache(model)) is None


def test_a_models_own_sliding_window_is_kept() -> None:
    config = {**TINY_CONFIG, "layer_types": ["full_attention", "sliding_attention"]}
    model = llama_module.Model(llama_module.ModelArgs.from_dict(config | {"sliding_window": 8}))
    cache = make_cache(model, 32)
    assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache]
    assert [(c.max_size, c.keep) for c in cache] == [(32, KEEP_TOKENS), (8, 0)]
    # A window without kept tokens attends to the same positions however prefill is chunked.
    assert chunking_exact_limit(cache) == 32
    assert chunking_exact_limit(make_cache(model)) is None


def test_the_bounded_cache_stays_within_max_kv_size(loaded: tuple[Any, Any]) -> None:
    model, _ = loaded
    cache = make_cache(model, 16)
    model(mx.array([list(range(100, 112))]), cache=cache)
    for token in range(60):
        mx.eval(model(mx.array([[200 + token]]), cache=cache))
    assert all(c.offset == 72 for c in cache)
    assert all(c.keys.shape[2] == 16 and c.values.shape[2] == 16 for c in cache)


async def test_engine_with_max_kv_size_matches_mlx_lm_with_rotating_caches(
    tiny_model_dir: Path, loaded: tuple[Any, Any]
) -> None:
    model, tokenizer = loaded
    async with trio_mlx.open_engine(tiny_model_dir, max_kv_size=16, max_num_seqs=1) as engine:
        prompt = list(engine.prepare_generate(PROMPT).prompt_tokens)
        assert len(prompt) < 16
        bounded = await engine.generate(prompt, max_tokens=48, temperature=0.0)
    async with trio_mlx.open_engine(tiny_model_dir) as engine:
        unbounded = await engine.generate(prompt, max_tokens=48, temperature=0.0)

    reference = []
    rotating = [RotatingKVCache(max_size=16, keep=4) for _ in model.layers]
    for response in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=48, prompt_cache=rotating
    ):
        if response.finish_reason == "stop" and response.token in tokenizer.eos_token_ids:
            break
        reference.append(response.token)
    assert bounded.tokens == reference
    assert all(c.offset == len(prompt) + 48 and c.keys.shape[2] == 16 for c in rotating)
    # The bound changed what was generated once the window was full.
    assert bounded.tokens[: 16 - len(prompt)] == unbounded.tokens[: 16 - len(prompt)]
    assert bounded.tokens != unbounded.tokens


async def test_prefix_caching_under_max_kv_size_only_reuses_prompts_within_the_window(
    tiny_model_dir: Path,
) -> None:
    short = [300 + i for i in range(40)]
    long = [500 + i for i in range(80)]

    async def run(cache_memory_bytes: int | None) -> tuple[list[list[int]], dict[str, Any]]:
        async with trio_mlx.open_engine(
            tiny_model_dir, max_kv_size=64, cache_memory_bytes=cache_memory_bytes
        ) as engine:
            outs = [
                await engine.generate(prompt, max_tokens=40, temperature=0.0)
                for prompt in (short, short, long, long, short[:30])
            ]
            return [o.tokens for o in outs] + [[o.cached_tokens for o in outs]], (
                engine.get_cache_stats()
            )

    cached, stats = await run(None)
    plain, _ = await run(0)
    assert cached[:-1] == plain[:-1]
    # The short prompt's retry and its prefix hit (the snapshot taken at the end of its prefill:
    # the final one would hold more than the window); the long prompt (past it) never does.
    assert cached[-1] == [0, 39, 0, 0, 29]
    assert stats["exact_prompt_limit"] == 64 and stats["bypassed"] == 2
    assert stats["cache_types"] == {"RotatingKVCache": 2}
