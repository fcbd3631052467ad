"""A client that goes away — mid-prefill, mid-decode, streaming or not, HTTP or WebSocket — aborts
its generation at the next step boundary and frees the engine for the next request."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import trio
from websockets.sync.client import connect

from idle import wait_until_idle
from model_wrappers import GatedModel, wrapping_loader
from servers import eventually, running_server
from trio_mlx.http.server import RunningServer

CHAT = "/v1/chat/completions"
LONG = {
    "messages": [{"role": "user", "content": "Count forever."}],
    "max_tokens": 900,
    "temperature": 0,
}


async def cancel_when_held(held: threading.Event, scope: trio.CancelScope) -> None:
    await trio.to_thread.run_sync(held.wait, 10.0)
    scope.cancel()


async def next_request_runs(http: httpx.AsyncClient) -> None:
    with trio.fail_after(10):
        reply = await http.post(CHAT, json={**LONG, "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3


async def test_disconnect_mid_decode_streaming(server: RunningServer) -> None:
    engine = server.state.engine
    assert engine is not None
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        before = engine.get_stats()["runner"]
        async with http.stream("POST", CHAT, json={**LONG, "stream": True}) as response:
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 3:
                        break
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] == before["aborted"] + 1
        generated = stats["runner"]["generated_tokens"] - before["generated_tokens"]
        assert generated < 900, "the generation stopped well before max_tokens"
        assert stats["finished"].get("abort", 0) >= 1
        await next_request_runs(http)


async def test_disconnect_mid_prefill_streaming_and_not(tiny_model_dir: Path) -> None:
    loader, made = wrapping_loader(GatedModel)
    async with running_server(tiny_model_dir, loader=loader, prefill_step_size=8) as server:
        engine = server.state.engine
        assert engine is not None
        gate = made[0].gate
        for stream in (True, False):
            before = engine.get_stats()["runner"]
            gate.clear()  # the runner blocks inside the first prefill chunk
            made[0].held.clear()
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                body = {**LONG, "stream": stream}
                async with trio.open_nursery() as nursery:
                    with trio.CancelScope() as waited:
                        # The client goes away once the runner is inside the prefill chunk.
                        nursery.start_soon(cancel_when_held, made[0].held, waited)
                        await http.post(CHAT, json=body)
                assert waited.cancelled_caught, "the request was still in prefill"
            # The client has gone; once the server has aborted its request (the abort is then
            # queued for the runner's next step boundary), let the runner finish the step it is
            # in. Released earlier, the runner could finish the prefill and sample before the
            # server noticed the closed connection.
            await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 0)
            gate.set()
            stats = await wait_until_idle(engine)
            assert stats["runner"]["aborted"] == before["aborted"] + 1
            assert stats["runner"]["generated_tokens"] == before["generated_tokens"]
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            await next_request_runs(http)


async def test_disconnect_non_streaming_mid_decode(server: RunningServer) -> None:
    engine = server.state.engine
    assert engine is not None
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        before = engine.get_stats()["runner"]

        def decoding() -> bool:
            return bool(
                engine.get_stats()["runner"]["generated_tokens"] > before["generated_tokens"]
            )

        async def go_away(scope: trio.CancelScope) -> None:
            await eventually(decoding)  # the client leaves once tokens are being generated
            scope.cancel()

        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:
                nursery.start_soon(go_away, scope)
                await http.post(CHAT, json=LONG)
        assert scope.cancelled_caught
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] == before["aborted"] + 1
        assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 900
        await next_request_runs(http)


async def test_websocket_close_aborts_the_response(server: RunningServer) -> None:
    engine = server.state.engine
    assert engine is not None
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    before = engine.get_stats()["runner"]

    def session() -> int:
        deltas = 0
        with connect(url) as ws:
            ws.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "input": "Count forever.",
                        "max_output_tokens": 900,
                        "temperature": 0,
                    }
                )
            )
            while deltas < 3:
                if json.loads(ws.recv(timeout=10))["type"] == "response.output_text.delta":
                    deltas += 1
        return deltas

    assert await trio.to_thread.run_sync(session) == 3
    stats = await wait_until_idle(engine)
    assert stats["runner"]["aborted"] == before["aborted"] + 1
    assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 900
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        await next_request_runs(http)
