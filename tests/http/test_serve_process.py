"""`trio-mlx serve` as a process: SIGTERM drains streams in flight, then exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from servers import serve_process

LONG = {
    "messages": [{"role": "user", "content": "Count forever."}],
    "max_tokens": 900,
    "temperature": 0,
    "stream": True,
}


def refuses_connections(url: str, attempts: int = 400) -> bool:
    """Whether new connections to `url` are refused within `attempts` tries (a few seconds):
    until the signal is handled, the server may still accept one."""
    with httpx.Client(base_url=url, timeout=5) as other:
        for _ in range(attempts):
            try:
                other.get("/health", headers={"Connection": "close"})
            except httpx.TransportError:
                return True
            time.sleep(0.01)  # bounded retry while the signal is being handled
    return False


def stream_then_terminate(process: subprocess.Popen[str], url: str) -> list[str]:
    """Start a long stream, SIGTERM the server after its first tokens; the stream's payloads."""
    payloads = []
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=LONG) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payloads.append(line[len("data: ") :])
            if len(payloads) == 2:
                process.send_signal(signal.SIGTERM)
    return payloads


@pytest.mark.parametrize("timeout", [60.0, 0.2])
def test_sigterm_drains_then_exits_zero(tiny_model_dir: Path, timeout: float) -> None:
    with serve_process(tiny_model_dir, "--shutdown-timeout", str(timeout)) as (process, url):
        payloads = stream_then_terminate(process, url)
        code = process.wait(timeout=60)
        assert process.stderr is not None
        log = process.stderr.read()
        assert code == 0, log[-3000:]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    last = json.loads(payloads[-2])
    if timeout > 1:  # the stream had time to finish
        assert last["choices"][0]["finish_reason"] == "length"
    else:  # it was cut short: an error event, then [DONE]
        assert last["error"]["code"] == "aborted"
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log
    assert "prompt=" in log and "completion=" in log


def wait_for_health(url: str, status: int, limit: float = 30.0) -> httpx.Response:
    """Poll /health until it answers `status` (bounded); the response."""
    deadline = time.monotonic() + limit
    with httpx.Client(base_url=url, timeout=10) as http:
        while True:
            response = http.get("/health")
            if response.status_code == status or time.monotonic() > deadline:
                return response
            time.sleep(0.02)


def test_health_answers_503_while_draining_and_new_work_is_refused(tiny_model_dir: Path) -> None:
    with serve_process(tiny_model_dir, "--shutdown-timeout", "60") as (process, url):
        with (
            httpx.Client(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=LONG) as response,
        ):
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            health = wait_for_health(url, 503)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "server_draining"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"]
        assert finish == "length"  # the stream in flight finished in full
        assert process.wait(timeout=60) == 0


def test_a_second_signal_ends_streams_with_an_error_event_and_exits_non_zero(
    tiny_model_dir: Path,
) -> None:
    with serve_process(tiny_model_dir, "--shutdown-timeout", "600") as (process, url):
        body = {**LONG, "max_tokens": 100_000}
        with (
            httpx.Client(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            assert wait_for_health(url, 503).json()["status"] == "draining"
            process.send_signal(signal.SIGTERM)
            rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and rest.count("[DONE]") == 1
        assert json.loads(rest[-2])["error"]["code"] == "aborted"
        code = process.wait(timeout=60)
        assert process.stderr is not None
        log = process.stderr.read()
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert "second SIGTERM" in log
