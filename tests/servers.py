"""Running the real HTTP server in a test's own Trio run, or as a `trio-mlx serve` process,
on 127.0.0.1 port 0."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from trio_mlx.engine.loading import load_model
from trio_mlx.http.server import RunningServer, serve_http
from trio_mlx.http.state import ServerSettings


@asynccontextmanager
async def running_server(
    model: Path,
    *,
    loader: Callable[..., Any] = load_model,
    wait_ready: bool = True,
    **settings: Any,
) -> AsyncIterator[RunningServer]:
    """Start a server (port 0), wait until its model is loaded, stop it on exit. Keywords that
    are not `ServerSettings` fields are engine options (`prefill_step_size=8`, ...)."""
    settings.setdefault("port", 0)
    fields = {f.name for f in dataclasses.fields(ServerSettings)}
    engine_options = {k: settings.pop(k) for k in list(settings) if k not in fields}
    settings["engine_options"] = engine_options
    async with trio.open_nursery() as nursery:
        server: RunningServer = await nursery.start(
            partial(serve_http, ServerSettings(model=model, **settings), loader=loader)
        )
        if wait_ready:
            with trio.fail_after(60):
                await server.state.ready.wait()
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


def keep_reading_log(process: subprocess.Popen[str], keep: int = 200) -> deque[str]:
    """Read the process's stderr on a daemon thread until it closes; returns the last `keep`
    lines, updated as they come."""
    assert process.stderr is not None
    stderr = process.stderr
    lines: deque[str] = deque(maxlen=keep)

    def read() -> None:
        with contextlib.suppress(ValueError, OSError):  # closed by serve_process on exit
            lines.extend(stderr)

    threading.Thread(target=read, daemon=True).start()
    return lines


async def eventually(predicate: Callable[[], Any], limit: float = 10.0) -> None:
    """Wait (polling) until `predicate()` is true; fail after `limit` seconds."""
    with trio.fail_after(limit):
        for _ in range(int(limit / 0.005) + 1):
            if await predicate() if inspect.iscoroutinefunction(predicate) else predicate():
                return
            await trio.sleep(0.005)


@contextmanager
def serve_process(model: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`python -m trio_mlx serve MODEL --port 0 ARGS`; yields the process and its URL once
    /health says ready; kills it on exit if it is still running.

    Its stderr (the log, an access-log line per request) is a pipe left to the caller: read it
    once the process has exited, or call `keep_reading_log` for anything longer than a few
    hundred requests — once the pipe is full the server blocks writing its log."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_mlx", "serve", str(model), "--port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        url = None
        for line in process.stderr:
            if "listening on " in line:
                url = line.strip().split("listening on ", 1)[1]
                break
        assert url is not None and url.startswith("http://127.0.0.1:")
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(600):
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        if process.stderr is not None:
            process.stderr.close()
