"""Prefill chunks sized by measured time: an abort during a long prefill frees the runner within
about one chunk (`prefill_chunk_seconds`), whatever the backend's speed, on both routes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from model_wrappers import _Wrapped, wrapping_loader
from servers import eventually

PROMPT_TOKENS = 900  # the tiny model's context is 1,024


class SlowModel(_Wrapped):
    """The real forward pass plus `per_token` seconds of compute for each position fed: the
    tiny model as a slow backend would run it (a 900-token chunk takes about 1.8 s)."""

    per_token = 0.002

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        #: set when a chunk of the long prompt starts (a pass of more than 16 positions)
        self.long_chunk = threading.Event()

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        if tokens.shape[1] > 16:
            self.long_chunk.set()
        time.sleep(self.per_token * int(tokens.shape[0] * tokens.shape[1]))
        return self._inner(tokens, cache=cache)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
async def test_an_abort_during_a_long_prefill_frees_the_runner_within_a_second(
    tiny_model_dir: Path, max_num_seqs: int
) -> None:
    loader, made = wrapping_loader(SlowModel)
    async with trio_mlx.open_engine(
        tiny_model_dir, loader=loader, max_num_seqs=max_num_seqs, admission="wait", max_waiting=4
    ) as engine:
        long_prompt = [1] + [100 + i % 500 for i in range(PROMPT_TOKENS - 1)]
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def long_request() -> None:
                with scope:
                    await engine.generate(long_prompt, max_tokens=4, temperature=0.0)

            nursery.start_soon(long_request)
            # A chunk of it is in the model: the prefill is under way.
            await eventually(made[0].long_chunk.is_set, limit=30)
            scope.cancel()
        short = await engine.generate("Hi", max_tokens=1, temperature=0.0)
        assert short.time_to_first_token is not None and short.time_to_first_token < 1.0
        stats = engine.get_stats()["runner"]
        assert stats["aborted"] == 1
        # The long prompt was cut into chunks of about 0.25 s, not one of 1.8 s.
        assert stats["prompt_tokens"] < PROMPT_TOKENS
