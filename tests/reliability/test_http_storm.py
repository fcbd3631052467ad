"""The HTTP server under abandonment, overload and faults: every answer is a 200 with a well-framed
stream or an OpenAI-shaped refusal, nothing is held afterwards, and the next request is served.

Bounded for CI; `pytest --long` multiplies the counts. Every loop is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from websockets.sync.client import connect

from idle import wait_until_idle
from model_wrappers import FaultyModel, break_the_runner_loop, wrapping_loader
from servers import running_server
from sse import chunks

CHAT = "/v1/chat/completions"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def words(rng: random.Random) -> str:
    # Distinct prompts, so that no request skips the prefill a client abandons.
    return " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(rng.randint(5, 120))
    )


@pytest.mark.skipif(
    not Path("/proc/self/fd").exists(),
    reason="no /proc on this machine (not Linux): open descriptors cannot be counted",
)
async def test_disconnect_storm_over_http_and_websocket(
    tiny_model_dir: Path, long_run: bool
) -> None:
    clients = 300 if long_run else 30
    rng = random.Random(4321)
    outcomes: dict[str, int] = {}
    async with running_server(
        tiny_model_dir,
        prefill_step_size=16,
        admission="wait",
        max_waiting=clients,
        max_wait=120.0,
    ) as server:
        engine = server.state.engine
        assert engine is not None
        ws_url = server.url.replace("http://", "ws://") + "/v1/responses"
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as warm:
            assert (
                await warm.post(
                    CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                )
            ).status_code == 200
        fds_before = open_fds()

        def count(outcome: str) -> None:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        async def http_client(i: int) -> None:
            give_up_after = rng.choice([0.0005, 0.005, 0.05, 0.3, 30.0]) * rng.random()
            stream = rng.random() < 0.8
            body = {
                "messages": [{"role": "user", "content": words(rng)}],
                "max_tokens": rng.randint(4, 80),
                "stream": stream,
            }
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                with trio.move_on_after(give_up_after) as scope:
                    response = await http.post(CHAT, json=body)
                    assert response.status_code == 200, response.text
                    if stream:
                        events = chunks(response.text)
                        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
                count("abandoned" if scope.cancelled_caught else "finished")

        def ws_client(deltas_before_leaving: int, tokens: int) -> str:
            with connect(ws_url) as ws:
                ws.send(
                    json.dumps(
                        {"type": "response.create", "input": "count", "max_output_tokens": tokens}
                    )
                )
                seen = 0
                while True:
                    event = json.loads(ws.recv(timeout=60))
                    if event["type"] == "response.output_text.delta":
                        seen += 1
                        if seen >= deltas_before_leaving:
                            return "abandoned"
                    if event["type"] in ("response.completed", "response.incomplete"):
                        return "finished"
                    assert event["type"] != "error", event

        async def socket_client(i: int) -> None:
            outcome = await trio.to_thread.run_sync(
                ws_client, rng.randint(1, 6), rng.randint(2, 40)
            )
            count(outcome)

        with trio.fail_after(600 if long_run else 120):
            async with trio.open_nursery() as nursery:
                for i in range(clients):
                    nursery.start_soon(socket_client if i % 5 == 4 else http_client, i)
                    await trio.sleep(0.002 * rng.random())
        stats = await wait_until_idle(engine, limit=30)
        assert sum(outcomes.values()) == clients
        assert outcomes.get("abandoned", 0) > 0 and stats["runner"]["aborted"] > 0
        assert stats["busy_rejections"] == 0  # wait mode: everyone was queued, nobody refused
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            with trio.fail_after(10):
                reply = await http.post(
                    CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
                )
            assert reply.json()["usage"]["completion_tokens"] == 3
            assert (await http.get("/health")).status_code == 200
        await wait_until_idle(engine, limit=30)
        # Every connection the storm opened is closed again (a little slack for the log).
        with trio.fail_after(10):
            for _ in range(1000):
                if open_fds() <= fds_before + 2:
                    break
                await trio.sleep(0.01)
        assert open_fds() <= fds_before + 2


@pytest.mark.parametrize("admission", ["fail-fast", "wait"])
async def test_overload_gets_200_or_429_never_5xx(
    tiny_model_dir: Path, long_run: bool, admission: str
) -> None:
    clients = 64 if long_run else 16
    options: dict[str, Any] = {"admission": admission}
    if admission == "wait":
        options |= {"max_waiting": clients // 2, "max_wait": 60.0}
    statuses: list[int] = []
    async with running_server(tiny_model_dir, **options) as server:
        engine = server.state.engine
        assert engine is not None

        async def client(i: int) -> None:
            body = {
                "messages": [{"role": "user", "content": f"client {i}"}],
                "max_tokens": 24,
                "stream": i % 2 == 0,
                "stream_options": {"include_usage": True},
            }
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                response = await http.post(CHAT, json=body)
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["type"] == "overloaded_error"
                return
            assert response.status_code == 200, response.text
            if body["stream"]:
                events = chunks(response.text)
                assert events[-1]["choices"] == []
                assert events[-1]["usage"]["completion_tokens"] <= 24
                assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
            else:
                assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")

        with trio.fail_after(300 if long_run else 120):
            async with trio.open_nursery() as nursery:
                for i in range(clients):
                    nursery.start_soon(client, i)
        await wait_until_idle(engine, limit=30)
    assert len(statuses) == clients
    assert set(statuses) <= {200, 429}
    assert 200 in statuses
    if admission == "fail-fast":
        assert 429 in statuses


async def test_model_faults_fail_one_request_and_the_server_keeps_serving(
    tiny_model_dir: Path,
) -> None:
    poison = 12345
    loader, _ = wrapping_loader(lambda inner: FaultyModel(inner, poison))
    async with (
        running_server(tiny_model_dir, loader=loader) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        bad = {"prompt": [1, 2, poison, 3], "max_tokens": 4}
        response = await http.post("/v1/completions", json=bad)
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "generation_error"
        response = await http.post("/v1/completions", json={**bad, "stream": True})
        assert response.status_code == 200
        payloads = response.text.split("\n\n")
        assert payloads[-2] == "data: [DONE]" and payloads.count("data: [DONE]") == 1
        error = json.loads(payloads[-3][len("data: ") :])
        assert error["error"]["code"] == "generation_error"
        good = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
        assert (await http.get("/health")).status_code == 200


async def test_a_dead_runner_turns_health_503_and_requests_get_503(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_the_runner_loop(monkeypatch)
    async with (
        running_server(tiny_model_dir) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        assert (await http.get("/health")).status_code == 200
        body = {"prompt": "x", "max_tokens": 50, "stream": True}
        response = await http.post("/v1/completions", json=body)
        payloads = response.text.split("\n\n")
        assert payloads[-2] == "data: [DONE]"
        assert json.loads(payloads[-3][len("data: ") :])["error"]["code"] == "generation_error"
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_crashed"


class _FailOnce:
    """A decode function that raises once, on its `after`-th call, then works again."""

    def __init__(self, decode: Any, after: int) -> None:
        self._decode = decode
        self.calls = 0
        self.after = after

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.after:
            raise ValueError("injected fault: the tokenizer could not decode")
        return self._decode(*args, **kwargs)


class _Proxy:
    def __init__(self, inner: Any, **overrides: Any) -> None:
        self.__dict__.update(overrides)
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_tokenizer_that_fails_to_decode_fails_one_request(tiny_model_dir: Path) -> None:
    from trio_mlx.engine.loading import load_model

    def loader(spec: Any) -> Any:
        import dataclasses

        loaded = load_model(spec)
        hf = loaded.tokenizer._tokenizer
        raw = _Proxy(hf._tokenizer, decode=_FailOnce(hf._tokenizer.decode, after=4).decode)
        wrapper = _Proxy(loaded.tokenizer, _tokenizer=_Proxy(hf, _tokenizer=raw))
        return dataclasses.replace(loaded, tokenizer=wrapper)

    async with (
        running_server(tiny_model_dir, loader=loader) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        engine = server.state.engine
        assert engine is not None
        body = {"prompt": "hello", "max_tokens": 12, "stream": True}
        response = await http.post("/v1/completions", json=body)
        payloads = response.text.split("\n\n")
        assert payloads[-2] == "data: [DONE]" and payloads.count("data: [DONE]") == 1
        error = json.loads(payloads[-3][len("data: ") :])["error"]
        assert error["code"] == "generation_error" and "decod" in error["message"]
        await wait_until_idle(engine, limit=30)
        ok = await http.post("/v1/completions", json={**body, "stream": False})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12
        assert (await http.get("/health")).status_code == 200


async def test_a_slow_client_does_not_hold_up_the_others(tiny_model_dir: Path) -> None:
    async with (
        running_server(tiny_model_dir) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "slow", "max_tokens": 3}).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        sent = trio.Event()
        answer: list[bytes] = []

        async def trickle() -> None:
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                for i in range(len(request)):  # one byte at a time, ~2 s in all
                    await stream.send_all(request[i : i + 1])
                    await trio.sleep(2.0 / len(request))
                sent.set()
                with trio.move_on_after(30):
                    while b"\r\n\r\n" not in b"".join(answer):
                        answer.append(await stream.receive_some())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            # Meanwhile other clients are served at once.
            for _ in range(3):
                with trio.fail_after(5):
                    reply = await http.post(
                        "/v1/completions", json={"prompt": "x", "max_tokens": 2}
                    )
                assert reply.status_code == 200
            assert not sent.is_set(), "the slow client was still sending"
        head = b"".join(answer).split(b"\r\n", 1)[0]
        assert head == b"HTTP/1.1 200 ", head
