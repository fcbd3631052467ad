"""`max_kv_size` on the batched route (tiny fp32 model): a bounded window keeps no leading
positions there (`prompt_cache`'s docstring: mlx-lm's batch window has none), so a request whose
prompt and reply run past its window gives the same tokens beside other requests as alone; a
restored cache that has not dropped a position loses its kept positions, one that has keeps
them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from mlx_lm.models.cache import RotatingKVCache

import trio_mlx
from trio_mlx.engine.prompt_cache import without_kept_tokens

CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a long story about the sea and ships."}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Count from one to twenty in words please, slowly."}],
]


async def test_requests_past_their_window_decode_beside_others_as_alone(
    tiny_model_dir: Path,
) -> None:
    greedy: dict[str, Any] = {"max_tokens": 40, "temperature": 0.0}
    async with trio_mlx.open_engine(
        tiny_model_dir,
        max_num_seqs=4,
        max_kv_size=24,
        admission="wait",
        max_waiting=8,
        cache_memory_bytes=0,
    ) as engine:
        prompts = [engine.prepare_chat(c).prompt_tokens for c in CONVERSATIONS]
        assert max(len(p) for p in prompts) > 24  # a prompt past the window
        alone = [(await engine.chat(c, **greedy)).tokens for c in CONVERSATIONS]
        together: list[list[int]] = [[] for _ in CONVERSATIONS]

        async def one(i: int) -> None:
            together[i] = (await engine.chat(CONVERSATIONS[i], **greedy)).tokens

        async with trio.open_nursery() as nursery:
            for i in range(len(CONVERSATIONS)):
                nursery.start_soon(one, i)
        assert max(int(n) for n in engine.get_stats()["runner"]["batch_sizes"]) >= 2
    assert together == alone
    assert all(len(tokens) == 40 for tokens in alone)  # every reply runs past the window too


def test_a_restored_window_loses_its_kept_positions_until_it_drops_one() -> None:
    fresh = RotatingKVCache(max_size=8, keep=4)
    fresh.update_and_fetch(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)))
    full = RotatingKVCache(max_size=8, keep=4)
    full.update_and_fetch(mx.zeros((1, 1, 12, 2)), mx.zeros((1, 1, 12, 2)))
    without_kept_tokens([fresh, full])
    assert fresh.keep == 0  # nothing dropped yet: as if built without kept positions
    assert full.keep == 4  # past its window: its kept positions are in its state
