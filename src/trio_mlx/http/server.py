"""Serving the HTTP app: `serve_http` (the `nursery.start` form) and `run_serve` (the CLI).

Order of life:
1. the listener is bound and `task_status.started(RunningServer)` is reported at once, so
   `/health` answers 503 while the model loads;
2. the engine is opened (`open_engine`) beside the server; routes use it once it is ready;
3. on `RunningServer.shutdown()` (the CLI calls it on SIGINT/SIGTERM) the server stops accepting
   connections and new requests get 503; streams in flight may finish for `shutdown_timeout`
   seconds, then the engine is closed, which ends each of them with an error event and
   `[DONE]`; once every connection has drained, the engine stops. A second signal stops at once.

A model that fails to load stops the server and `serve_http` raises the load error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from trio_mlx.actors.runner import ModelLoader
from trio_mlx.actors.supervisor import open_engine
from trio_mlx.engine.loading import load_model
from trio_mlx.http.app import create_app
from trio_mlx.http.state import ServerSettings, ServerState

log = logging.getLogger("trio_mlx.server")

#: Time given to streams to write their final events once the engine has closed them.
FINAL_WRITE_GRACE = 3.0


@dataclass
class RunningServer:
    """A started server: where it listens, its state, and how to stop it gracefully."""

    url: str
    state: ServerState
    shutdown: Callable[[], None]


async def serve_http(
    settings: ServerSettings,
    *,
    loader: ModelLoader = load_model,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown()` (graceful) or cancellation (immediate)."""
    state = ServerState(settings)
    app = create_app(state)
    config = HypercornConfig()
    config.bind = [_bind(settings.host, settings.port)]
    config.graceful_timeout = settings.shutdown_timeout + FINAL_WRITE_GRACE
    config.accesslog = None  # our own access log has tokens and timings
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    http_stopped = trio.Event()
    load_error: list[BaseException] = []

    def shutdown() -> None:
        if not stop.is_set():
            log.info("shutting down: draining for up to %.1f s", settings.shutdown_timeout)
        state.draining = True
        stop.set()

    async def run_engine() -> None:
        started = time.monotonic()
        try:
            async with open_engine(
                settings.model, loader=loader, **settings.engine_options
            ) as engine:
                state.engine = engine
                state.ready.set()
                log.info(
                    "model %s ready (%.1f s); serving as %s",
                    engine.model_name,
                    time.monotonic() - started,
                    ", ".join(state.model_names),
                )
                await stop.wait()
                with trio.move_on_after(settings.shutdown_timeout):
                    await http_stopped.wait()
                engine.close()  # streams still running end with an error event and [DONE]
                await http_stopped.wait()
        except Exception as exc:
            if state.engine is None:
                state.load_error = exc
                load_error.append(exc)
                log.error("the model failed to load: %s", exc)
                shutdown()
            else:
                raise

    async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
        finally:
            http_stopped.set()

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(run_http)
        nursery.start_soon(run_engine)
        task_status.started(RunningServer(url=binds[0], state=state, shutdown=shutdown))
    if load_error:
        raise load_error[0]


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """`trio-mlx serve` arguments (see `cli.py`) as `ServerSettings`."""
    engine_options: dict[str, object] = {
        "admission": args.admission,
        "max_waiting": args.max_waiting,
        "max_wait": args.max_wait,
        "prefill_step_size": args.prefill_step_size,
        "prefill_block": getattr(args, "prefill_block", None),
        "fused_tail_tokens": getattr(args, "fused_tail_tokens", None),
        "max_tokens_limit": args.max_tokens,
        "default_max_tokens": args.default_max_tokens,
        "max_kv_size": args.max_kv_size,
        "max_num_seqs": getattr(args, "max_num_seqs", None),
        "prefill_chunk_seconds": getattr(args, "prefill_chunk_seconds", 0.25),
    }
    kv_mb = getattr(args, "kv_memory_mb", None)
    if kv_mb is not None:
        engine_options["kv_memory_bytes"] = int(kv_mb * 1024 * 1024)
    cache_mb = getattr(args, "cache_memory_mb", None)
    if cache_mb is not None:
        engine_options["cache_memory_bytes"] = int(cache_mb * 1024 * 1024)
    return ServerSettings(
        model=Path(args.model) if args.model and Path(args.model).exists() else args.model,
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        engine_options=engine_options,
    )


def run_serve(args: argparse.Namespace) -> int:
    """`trio-mlx serve`: serve until SIGINT/SIGTERM, drain, exit 0 (1 if the model failed)."""
    for name in ("trio_mlx", "hypercorn.error"):
        logging.getLogger(name).setLevel(logging.INFO)
    return trio.run(_serve_until_signalled, settings_from_args(args))


async def _serve_until_signalled(settings: ServerSettings) -> int:
    failure: list[BaseException] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[RunningServer]) -> None:
                try:
                    await serve_http(settings, task_status=task_status)
                except Exception as exc:
                    failure.append(exc)
                finally:
                    nursery.cancel_scope.cancel()

            server: RunningServer = await nursery.start(serve)
            print(f"trio-mlx: listening on {server.url}", file=sys.stderr, flush=True)
            nursery.start_soon(partial(_on_signals, signals, server, nursery.cancel_scope))
    if failure:
        print(f"trio-mlx: error: {failure[0]}", file=sys.stderr)
        return 1
    return 0


async def _on_signals(
    signals: AsyncIterator[int], server: RunningServer, scope: trio.CancelScope
) -> None:
    count = 0
    async for signum in signals:
        count += 1
        if count == 1:
            log.info("received %s", signal.Signals(signum).name)
            server.shutdown()
        else:
            log.warning("second signal: stopping now")
            scope.cancel()
