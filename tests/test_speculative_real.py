"""Speculative decoding on real weights: the bundled 4-bit SmolLM2 drafting for its own weights
dequantized to float32. The two compute the same function up to rounding, so nearly every
drafted token must be accepted, and greedy output must be the dense target's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import trio_mlx
from trio_mlx.engine.model_spec import resolve_model_path

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write two sentences about the sea."}]


@pytest.fixture(scope="module")
def dense_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    source = resolve_model_path(None).path
    out = tmp_path_factory.mktemp("dense") / "smollm2-fp32"
    out.mkdir()
    model, config = load_model(source)
    dequantize_model(model)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


async def test_the_4bit_smollm2_drafts_for_its_dense_copy(dense_smollm2: Path) -> None:
    sampling = {"max_tokens": 32, "temperature": 0.0}
    async with trio_mlx.open_engine(dense_smollm2) as engine:
        plain = await engine.chat(MESSAGES, **sampling)
    async with trio_mlx.open_engine(dense_smollm2, draft_model=_bundled()) as engine:
        drafted = await engine.chat(MESSAGES, **sampling)
        stats = engine.get_stats()["speculative"]
    assert drafted.tokens == plain.tokens
    assert stats["drafted_tokens"] > 0
    assert stats["acceptance_rate"] > 0.9


def _bundled() -> Path:
    return resolve_model_path(None).path
