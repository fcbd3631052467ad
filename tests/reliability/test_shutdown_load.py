"""SIGTERM with many streams in flight (one running, the others queued: checked through
`/v1/status` before the signal): every stream ends well-framed within the shutdown timeout, and
the process exits 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from servers import serve_process
from sse import chunks


def all_in_flight(url: str, clients: int) -> dict[str, int]:
    """`/v1/status` once all `clients` requests have been admitted or queued and one still runs
    (bounded: a few seconds)."""
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(1000):
            stats = http.get("/v1/status").json()
            if stats["admitted"] + stats["waiting"] >= clients and stats["running"] == 1:
                return {k: stats[k] for k in ("running", "waiting", "admitted")}
            time.sleep(0.005)
    raise AssertionError(f"the {clients} requests never were all in flight: {stats}")


def test_sigterm_under_load_drains_every_stream(tiny_model_dir: Path, long_run: bool) -> None:
    clients = 24 if long_run else 8
    results: list[tuple[int, str]] = []
    with serve_process(
        tiny_model_dir,
        "--admission",
        "wait",
        "--max-waiting",
        str(clients),
        "--shutdown-timeout",
        "60",
        "--max-num-seqs",
        "1",  # one stream running, the others queued
    ) as (process, url):
        started = threading.Barrier(clients + 1, timeout=60)

        def client(i: int) -> None:
            body = {"prompt": f"client {i}", "max_tokens": 120, "stream": True}
            with httpx.Client(base_url=url, timeout=120) as http:
                started.wait()
                response = http.post("/v1/completions", json=body)
                results.append((response.status_code, response.text))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        started.wait()
        # SIGTERM once every client is in flight: one stream running, the others queued.
        in_flight = all_in_flight(url, clients)
        assert in_flight["running"] == 1 and in_flight["waiting"] >= 1, in_flight
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=120)
        assert process.wait(timeout=120) == 0
        drained_in = time.monotonic() - began
    assert len(results) == clients
    finished = 0
    for status, text in results:
        # Requests that reached the server before SIGTERM are served to the end; none is cut.
        assert status == 200, text
        events = chunks(text)
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        finished += 1
    assert finished == clients
    assert drained_in < 60
