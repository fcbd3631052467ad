"""The runner thread never waits for the event loop: with the Trio thread held (no checkpoint),
it still starts a job (consulting the prefix-cache book), prefills, decodes, snapshots and
enters the snapshot in the book, and restores it for the next job."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import trio_mlx
from idle import wait_until_idle
from trio_mlx.actors.kv_cache_manager import KVCacheManager

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "Name three colours."}


async def test_the_runner_serves_a_request_while_the_event_loop_is_held(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversation_stored = threading.Event()
    stored = KVCacheManager.stored

    def noting(self: KVCacheManager, tokens: Any, nbytes: int, kind: Any, *rest: Any) -> Any:
        decision = stored(self, tokens, nbytes, kind, *rest)
        if kind == "conversation":
            conversation_stored.set()
        return decision

    monkeypatch.setattr(KVCacheManager, "stored", noting)
    async with trio_mlx.open_engine(tiny_model_dir, prefill_step_size=8) as engine:
        held: list[bool] = []
        for _ in range(2):  # the first stores the conversation, the second restores it
            conversation_stored.clear()
            request = await engine.prepare_chat_async([SYSTEM, USER], max_tokens=4, temperature=0)
            active = await engine.start_request(request)  # submitted: the runner starts it
            try:
                # Hold the event loop (a blocking wait, no checkpoint) until the runner has
                # run the whole request and entered its snapshot in the book.
                held.append(conversation_stored.wait(timeout=10))
                async for out in active.stream:
                    if out.finished:
                        break
            finally:
                active.close()
            assert out.finish_reason == "length"
        assert held == [True, True]
        stats = engine.get_cache_stats()
        assert stats["hits"] == 1 and stats["restores"] == 1
        await wait_until_idle(engine)
