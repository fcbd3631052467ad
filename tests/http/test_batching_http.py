"""Many users at once over HTTP: 64 concurrent streams against `--max-num-seqs 16 --admission
wait`. Every stream is a 200 with its whole completion and `[DONE]`; afterwards no slot is held
and the engine is idle. And `trio-mlx serve`'s command line reaches the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from servers import eventually, running_server
from sse import chunks
from trio_mlx.cli import build_parser
from trio_mlx.http.server import settings_from_args

CHAT = "/v1/chat/completions"
STREAMS = 64
MAX_TOKENS = 4


async def test_64_concurrent_streams_against_16_slots_all_complete(tiny_model_dir: Path) -> None:
    async with running_server(
        tiny_model_dir, max_num_seqs=16, admission="wait", max_waiting=STREAMS, max_wait=120.0
    ) as server:
        engine = server.state.engine
        assert engine is not None
        results: dict[int, tuple[int, list[dict[str, Any]]]] = {}
        most_running = 0

        async def stream(i: int, client: httpx.AsyncClient) -> None:
            body = {
                "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logit_bias": {"2": -100},  # no EOS: every stream generates MAX_TOKENS
            }
            async with client.stream("POST", CHAT, json=body) as response:
                text = (await response.aread()).decode()
                results[i] = (response.status_code, chunks(text) if response.is_success else [])

        async def watch() -> None:
            nonlocal most_running
            while len(results) < STREAMS:
                most_running = max(most_running, engine.get_stats()["running"])
                await trio.sleep(0.01)

        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            with trio.fail_after(240):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    for i in range(STREAMS):
                        nursery.start_soon(stream, i, client)
        assert sorted(results) == list(range(STREAMS))
        assert {status for status, _ in results.values()} == {200}
        for _status, parts in results.values():
            usage = parts[-1]["usage"]
            assert usage["completion_tokens"] == MAX_TOKENS
            finishes = [c["choices"][0]["finish_reason"] for c in parts if c["choices"]]
            assert finishes[-1] == "length"
        assert 1 < most_running <= 16
        await eventually(lambda: not engine.get_stats()["runner"]["live_sequences"])
        stats = engine.get_stats()
        assert stats["running"] == stats["waiting"] == 0 and stats["slot_holders"] == []
        assert stats["runner"]["requests_in_flight"] == 0 and stats["kv_reserved_bytes"] == 0
        assert stats["finished"] == {"length": STREAMS}
        assert max(int(size) for size in stats["runner"]["batch_sizes"]) > 1
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            metrics = (await client.get("/metrics")).text
        assert 'trio_mlx:num_sequences_decoding{model_name="tiny-llama"} 0' in metrics
        assert "trio_mlx:decode_steps_by_batch_size_total{" in metrics


def test_serve_defaults_to_the_wait_queue_and_passes_batching_options() -> None:
    args = build_parser().parse_args(["serve"])
    options = settings_from_args(args).engine_options
    assert options["admission"] == "wait" and options["max_waiting"] > 0
    assert options["max_num_seqs"] is None  # the backend's default
    args = build_parser().parse_args(
        ["serve", "--max-num-seqs", "16", "--kv-memory-mb", "512", "--admission", "fail-fast"]
    )
    options = settings_from_args(args).engine_options
    assert options["max_num_seqs"] == 16 and options["admission"] == "fail-fast"
    assert options["kv_memory_bytes"] == 512 * 1024 * 1024
