"""Serving the HTTP app: `serve_http` (the `nursery.start` form) and `run_serve` (the CLI).

Order of life:
1. the listener is bound and `task_status.started(RunningServer)` is reported at once, so
   `/health` answers 503 while the model loads;
2. the engine is opened (`open_engine`) beside the server; routes use it once it is ready;
3. on `RunningServer.shutdown()` (the CLI calls it on the first SIGINT/SIGTERM) the server keeps
   listening but refuses new work: `/health` and every new request get 503. Requests in flight
   (background responses included: `http/responses/background.py`) may finish for
   `shutdown_timeout` seconds; then the engine is closed, which ends each stream still running
   with an error event and `[DONE]` (a background response `failed`); once they have been
   written (at most `FINAL_WRITE_GRACE` seconds) the background responses still running are
   cancelled, the listener closes and `serve_http` returns;
4. `RunningServer.abort()` (the CLI's second signal) skips the wait of step 3: streams end with
   their error event and `[DONE]` at once.

A model that fails to load stops the server and `serve_http` raises the load error. A shutdown
while the model is still loading stops the load.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from trio_mlx.actors.runner_start import ModelLoader
from trio_mlx.actors.supervisor import open_engine
from trio_mlx.config import SERVER_PROCESS_SETTINGS
from trio_mlx.engine.loading import load_model
from trio_mlx.http import fast_send
from trio_mlx.http.app import create_app
from trio_mlx.http.preflight import (
    StartupError,
    bind_error,
    check_listen,
    check_model,
    first_os_error,
)
from trio_mlx.http.responses.store import DEFAULT_MEGABYTES, DEFAULT_RESPONSES
from trio_mlx.http.state import ServerSettings, ServerState
from trio_mlx.multimodal.media import MediaPolicy

log = logging.getLogger("trio_mlx.server")

#: Time given to streams to write their final events once the engine has closed them.
FINAL_WRITE_GRACE = 3.0


@dataclass
class RunningServer:
    """A started server: where it listens, its state, and how to stop it."""

    url: str
    state: ServerState
    #: Drain: refuse new work, let requests in flight finish for `shutdown_timeout` seconds.
    shutdown: Callable[[], None]
    #: Stop now: streams in flight end with an error event and `[DONE]`.
    abort: Callable[[], None]


async def serve_http(
    settings: ServerSettings,
    *,
    loader: ModelLoader = load_model,
    on_ready: Callable[[RunningServer], None] | None = None,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown()` / `abort()` or cancellation (immediate).

    `on_ready(server)` is called once the model has loaded.
    """
    state = ServerState(settings)
    app = create_app(state)
    config = HypercornConfig()
    config.bind = [_bind(settings.host, settings.port)]
    config.graceful_timeout = FINAL_WRITE_GRACE
    config.accesslog = None  # our own access log has tokens and timings
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    stop_now = trio.Event()
    close_listener = trio.Event()
    load_scope = trio.CancelScope()
    load_error: list[BaseException] = []
    running: list[RunningServer] = []

    def shutdown() -> None:
        if not stop.is_set() and state.load_error is None:
            log.info("shutting down: draining for up to %.1f s", settings.shutdown_timeout)
        state.draining = True
        stop.set()
        if state.engine is None:
            load_scope.cancel()

    def abort() -> None:
        shutdown()
        stop_now.set()

    async def drain(engine_close: Callable[[], None]) -> None:
        with trio.move_on_after(settings.shutdown_timeout):
            async with trio.open_nursery() as waits:

                async def idle() -> None:
                    await state.wait_idle()
                    waits.cancel_scope.cancel()

                async def now() -> None:
                    await stop_now.wait()
                    waits.cancel_scope.cancel()

                waits.start_soon(idle)
                waits.start_soon(now)
        if state.in_flight:
            log.info("ending %d request(s) still in flight", state.in_flight)
        engine_close()  # streams still running end with an error event and [DONE]
        with trio.move_on_after(FINAL_WRITE_GRACE):
            await state.wait_idle()

    async def run_engine() -> None:
        started = time.monotonic()
        try:
            with load_scope:
                async with open_engine(
                    settings.model, loader=loader, **settings.engine_options
                ) as engine:
                    state.engine = engine
                    # Background responses run while the engine serves; a drain waits for
                    # them as for the requests in flight, and those left are cancelled.
                    async with state.background.serving():
                        state.ready.set()
                        log.info(
                            "model %s ready (%.1f s); serving as %s",
                            engine.model_name,
                            time.monotonic() - started,
                            ", ".join(state.model_names),
                        )
                        if on_ready is not None and running:
                            on_ready(running[0])
                        await stop.wait()
                        await drain(engine.close)
        except Exception as exc:
            if state.engine is None:
                state.load_error = exc
                load_error.append(exc)
                log.debug("the model failed to load: %s", exc)
                shutdown()
            else:
                raise
        finally:
            close_listener.set()

    async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
        fast_send.install()
        await hypercorn_serve(
            app, config, shutdown_trigger=close_listener.wait, task_status=task_status
        )

    bind_failure: list[StartupError] = []
    async with trio.open_nursery() as nursery:
        try:
            binds: list[str] = await nursery.start(run_http)
        except (OSError, BaseExceptionGroup) as exc:
            if first_os_error(exc) is None:
                raise
            bind_failure.append(bind_error(settings.host, settings.port, exc))
        else:
            server = RunningServer(url=binds[0], state=state, shutdown=shutdown, abort=abort)
            running.append(server)
            nursery.start_soon(run_engine)
            task_status.started(server)
    if bind_failure:
        raise bind_failure[0]
    if load_error:
        raise load_error[0]


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """`trio-mlx serve` arguments (see `cli_options.py`) as `ServerSettings`."""
    engine_options: dict[str, object] = {
        **SERVER_PROCESS_SETTINGS,  # a server owns its process (EngineConfig says why)
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
        "compiled_decode": getattr(args, "compiled_decode", None),
        "lean_decode": getattr(args, "lean_decode", None),
        "traced_batch_rows": getattr(args, "traced_batch_rows", None),
        "fused_projections": getattr(args, "fused_projections", None),
        "cuda_graphs": getattr(args, "cuda_graphs", None),
        "dequantize_from_rows": getattr(args, "dequantize_from_rows", None),
    }
    engine_options["force_mllm"] = bool(getattr(args, "mllm", False))
    engine_options["media"] = media_policy_from_args(args)
    mllm_draft = getattr(args, "mllm_draft_model", None)
    if mllm_draft:
        engine_options["mllm_draft_model"] = (
            Path(mllm_draft) if Path(mllm_draft).exists() else mllm_draft
        )
        engine_options["mllm_draft_kind"] = getattr(args, "mllm_draft_kind", None)
        engine_options["mllm_draft_block_size"] = getattr(args, "mllm_draft_block_size", None)
    draft = getattr(args, "draft_model", None)
    if draft:
        engine_options["draft_model"] = Path(draft) if Path(draft).exists() else draft
        engine_options["num_draft_tokens"] = args.num_draft_tokens
    draft_layers = getattr(args, "draft_layers", None)
    if draft_layers is not None:
        engine_options["draft_layers"] = draft_layers
        engine_options["num_draft_tokens"] = args.num_draft_tokens
    if getattr(args, "mtp", False):
        engine_options["mtp"] = True
        engine_options["mtp_num_draft_tokens"] = args.mtp_num_draft_tokens
    if getattr(args, "specprefill", False):
        scorer = getattr(args, "specprefill_draft_model", None)
        engine_options["specprefill_enabled"] = True
        engine_options["specprefill_threshold"] = args.specprefill_threshold
        engine_options["specprefill_keep_pct"] = args.specprefill_keep_pct
        engine_options["specprefill_backbone_pct"] = args.specprefill_backbone_pct
        if scorer:
            engine_options["specprefill_draft_model"] = (
                Path(scorer) if Path(scorer).exists() else scorer
            )
        scoring_layers = getattr(args, "specprefill_draft_layers", None)
        if scoring_layers is not None:
            engine_options["specprefill_draft_layers"] = scoring_layers
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
        api_key=getattr(args, "api_key", None) or None,
        tool_call_parser=getattr(args, "tool_call_parser", "auto"),
        response_store_size=getattr(args, "response_store_size", DEFAULT_RESPONSES),
        response_store_bytes=int(
            getattr(args, "response_store_mb", DEFAULT_MEGABYTES) * 1024 * 1024
        ),
        engine_options=engine_options,
    )


def media_policy_from_args(args: argparse.Namespace) -> MediaPolicy:
    """The media flags of `trio-mlx serve` as the engine's `MediaPolicy`."""
    local = getattr(args, "allowed_local_media_path", None)
    return MediaPolicy(
        allowed_local_dir=Path(local).expanduser() if local else None,
        allow_private_urls=bool(getattr(args, "allow_private_media_urls", False)),
        max_bytes=int(getattr(args, "max_media_mb", 20.0) * 1024 * 1024),
        video_fps=getattr(args, "video_fps", 2.0),
        video_max_frames=getattr(args, "video_max_frames", 16),
    )


def run_serve(args: argparse.Namespace) -> int:
    """`trio-mlx serve`: check, serve until a signal, drain; the exit status.

    0 after a drain; 1 when the model failed to load; 128 + the signal's number when a second
    signal cut streams short. `StartupError` (a busy port, a bad host, a missing model...)
    propagates to the CLI, which prints its one line.
    """
    settings = settings_from_args(args)
    check_listen(settings.host, settings.port)
    check_model(settings.model)
    for key in ("draft_model", "mllm_draft_model"):
        draft = settings.engine_options.get(key)
        if isinstance(draft, str | Path):
            check_model(draft)
    return trio.run(_serve_until_signalled, settings)


async def _serve_until_signalled(settings: ServerSettings) -> int:
    failure: list[BaseException] = []
    aborted: list[int] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            def ready(server: RunningServer) -> None:
                log.info("listening on %s", server.url)

            async def serve(task_status: trio.TaskStatus[RunningServer]) -> None:
                try:
                    await serve_http(settings, on_ready=ready, task_status=task_status)
                except Exception as exc:
                    failure.append(exc)
                finally:
                    nursery.cancel_scope.cancel()

            server: RunningServer = await nursery.start(serve)
            log.info(
                "loading %s; %s answers 503 until it is ready",
                settings.model or "the bundled model",
                server.url,
            )
            nursery.start_soon(partial(_on_signals, signals, server, nursery.cancel_scope, aborted))
    if failure:
        if isinstance(failure[0], StartupError):
            raise failure[0]
        message = str(failure[0])
        if not message.startswith("the model"):
            message = f"the model failed to load: {message}"
        raise StartupError(message, exit_code=1) from failure[0]
    return 128 + aborted[0] if aborted else 0


async def _on_signals(
    signals: AsyncIterator[int], server: RunningServer, scope: trio.CancelScope, aborted: list[int]
) -> None:
    count = 0
    async for signum in signals:
        count += 1
        if count == 1:
            log.info("received %s", signal.Signals(signum).name)
            server.shutdown()
        elif count == 2:
            log.warning("second %s: ending the requests in flight now", signal.Signals(signum).name)
            aborted.append(signum)
            server.abort()
        else:
            scope.cancel()
