"""Generation requests are noted as on their way to the engine from the moment their body has
arrived until they are admitted or refused (`http/in_flight.NoteArrivals`), so that a burst's
first arrivals wait for the rest before they decode; whatever the outcome (streamed, whole,
refused as invalid or busy, the client gone), nothing stays noted."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from idle import wait_until_idle
from servers import eventually, running_server
from trio_mlx.actors.engine import Arrival

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


async def test_every_generation_request_is_noted_until_it_is_admitted_or_refused(
    tiny_model_dir: Path,
) -> None:
    async with running_server(tiny_model_dir, max_num_seqs=2) as server:
        engine = server.state.engine
        assert engine is not None
        noted: list[Arrival] = []
        arriving = engine.arriving

        def note() -> Arrival:
            noted.append(arriving())
            return noted[-1]

        engine.arriving = note  # type: ignore[method-assign]
        bodies: list[dict[str, Any]] = [
            {"messages": MESSAGES, "max_tokens": 3, "stream": True},
            {"messages": MESSAGES, "max_tokens": 3},
            {"messages": MESSAGES, "max_tokens": 3, "temperature": "hot"},  # 400
            {"model": "no-such-model", "messages": MESSAGES},  # 404
        ]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            statuses = [(await client.post(CHAT, json=body)).status_code for body in bodies]
            assert (await client.get("/health")).status_code == 200  # not a generation
            completion = await client.post(
                "/v1/completions", json={"prompt": "The sea", "max_tokens": 2}
            )
        assert statuses == [200, 200, 400, 404]
        assert completion.status_code == 200
        assert len(noted) == 5
        await wait_until_idle(engine)  # nothing noted as on its way any more


async def test_a_client_gone_before_admission_leaves_nothing_noted(tiny_model_dir: Path) -> None:
    """Every slot is held, so the request waits in the admission queue; its client goes."""
    async with running_server(
        tiny_model_dir, max_num_seqs=2, admission="wait", max_waiting=4, max_wait=60.0
    ) as server:
        engine = server.state.engine
        assert engine is not None
        held = [
            await engine.start_request(engine.prepare_generate("hold", max_tokens=2))
            for _ in range(2)
        ]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as nursery:
                    body = {"messages": MESSAGES, "max_tokens": 2}
                    nursery.start_soon(partial(client.post, CHAT, json=body))
                    await eventually(lambda: engine.get_stats()["waiting"] == 1)
                    assert engine.get_stats()["runner"]["arriving"] == 0  # entered admission
                    nursery.cancel_scope.cancel()
            assert not scope.cancelled_caught
        await eventually(lambda: engine.get_stats()["waiting"] == 0)  # it left the queue
        for active in held:
            active.close()
        stats = await wait_until_idle(engine)
        assert stats["admitted"] == 2
