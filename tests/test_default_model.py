"""End to end on the real bundled model: SmolLM2-135M-Instruct from its GGUF, on this machine's MLX.

Slow-ish on a 2-core CPU (conversion once, then ~6 tokens/s), so it is marked `slow`; CI runs it.
"""

from __future__ import annotations

import pytest

import trio_mlx


@pytest.mark.slow
async def test_the_bundled_default_model_says_paris_is_the_capital_of_france() -> None:
    text = ""
    async with trio_mlx.open_engine() as engine:
        assert engine.model_name == "SmolLM2-135M-Instruct"
        async for out in engine.stream_chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
        ):
            text += out.new_text
    assert "Paris" in text
    assert out.finish_reason == "stop"
