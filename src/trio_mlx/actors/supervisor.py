"""Starting and stopping an engine inside a Trio program.

`serve_engine` is the `nursery.start` form: it starts the actors in dependency order (the runner
first: it loads the model; admission needs nothing), reports the `Engine` as started, and serves
until cancelled. On the way out it closes the engine (new requests refused, requests in flight end
with `finish_reason="abort"`), then the runner thread stops at its next step boundary.

`open_engine` is the `async with` form for programs that want the engine for a block.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from trio_mlx.actors.admission import AdmissionBook, AdmissionController
from trio_mlx.actors.engine import Engine
from trio_mlx.actors.kv_cache_manager import KVCacheManager
from trio_mlx.actors.model_info import ModelInfo
from trio_mlx.actors.runner import Runner
from trio_mlx.actors.runner_start import ModelLoader
from trio_mlx.config import EngineConfig
from trio_mlx.engine.batch_sizing import default_max_num_seqs, device_memory_bytes
from trio_mlx.engine.kv_snapshots import SnapshotSupport
from trio_mlx.engine.loading import load_model
from trio_mlx.engine.mlx_cuda import keep_attention_graphs, use_cuda_graphs
from trio_mlx.engine.specprefill import SpecPrefillSettings
from trio_mlx.errors import EngineCrashed


async def serve_engine(
    model: str | Path | None = None,
    *,
    loader: ModelLoader = load_model,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
    **config: Any,
) -> None:
    """Run an engine until cancelled; `task_status.started(engine)` once the model is loaded.

    `config` are `EngineConfig` fields. `loader` turns the model spec into a loaded model (tests
    use it to wrap the model). A model that cannot be loaded raises before `started`. Nothing
    process-wide changes unless `config` asks (`gil_switch_interval`, `cuda_sdpa_graph_cache`,
    `cuda_graphs`, `freeze_gc`).
    """
    cfg = EngineConfig(model=model, **config)
    if cfg.cuda_sdpa_graph_cache is not None:
        keep_attention_graphs(cfg.cuda_sdpa_graph_cache)
    if cfg.cuda_graphs is not None:
        use_cuda_graphs(cfg.cuda_graphs)
    with _gil_switch_interval(cfg.gil_switch_interval):
        await _serve(cfg, loader, task_status)


async def _serve(
    cfg: EngineConfig, loader: ModelLoader, task_status: trio.TaskStatus[Engine]
) -> None:
    max_num_seqs = cfg.max_num_seqs or default_max_num_seqs()
    if cfg.force_mllm and loader is load_model:
        loader = partial(load_model, force_mllm=True)
    runner = Runner(
        cfg.model,
        prefill_step_size=cfg.prefill_step_size,
        prefill_block=cfg.prefill_block,
        fused_tail_tokens=cfg.fused_tail_tokens,
        max_kv_size=cfg.max_kv_size,
        max_num_seqs=max_num_seqs,
        prefill_chunk_seconds=cfg.prefill_chunk_seconds,
        compiled_decode=cfg.compiled_decode,
        traced_batch_rows=cfg.traced_batch_rows,
        fused_projections=cfg.fused_projections,
        lean_decode=cfg.lean_decode,
        dequantize_from_rows=cfg.dequantize_from_rows,
        loader=loader,
        draft_model=cfg.draft_model,
        draft_layers=cfg.draft_layers,
        num_draft_tokens=cfg.num_draft_tokens,
        mtp=cfg.mtp,
        mtp_num_draft_tokens=cfg.mtp_num_draft_tokens,
        specprefill_model=cfg.specprefill_scorer,
        specprefill_layers=cfg.specprefill_scorer_layers,
        specprefill=SpecPrefillSettings(
            enabled=cfg.specprefill_enabled,
            threshold=cfg.specprefill_threshold,
            keep_pct=cfg.specprefill_keep_pct,
            backbone_pct=cfg.specprefill_backbone_pct,
        ),
        mllm_draft_model=cfg.mllm_draft_model,
        mllm_draft_kind=cfg.mllm_draft_kind,
        mllm_draft_block_size=cfg.mllm_draft_block_size,
    )
    book = AdmissionBook(slots=max_num_seqs, mode=cfg.admission_mode, max_waiting=cfg.max_waiting)
    admission = AdmissionController(book, max_wait=cfg.max_wait)
    load_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        try:
            info = await nursery.start(runner.run)
        except Exception as exc:  # raised as it is, not inside this nursery's ExceptionGroup
            load_error = exc
        else:
            if not runner.batching:
                book.slots = 1  # the model's cache cannot be batched: the serialized route
            elif cfg.kv_memory_bytes != 0:
                book.account_kv(_kv_budget(cfg, info), runner.kv_bytes_per_token)
            kv_cache = _kv_cache_manager(cfg, info)
            runner.use_prefix_cache(kv_cache)
            engine = Engine(cfg, runner, admission, info, kv_cache)
            try:
                with _frozen_gc(cfg.freeze_gc):
                    task_status.started(engine)
                    await trio.sleep_forever()
            finally:
                engine.close()
                nursery.cancel_scope.cancel()
    if load_error is not None:
        raise load_error


def _kv_budget(cfg: EngineConfig, info: ModelInfo) -> int:
    """The running sequences' KV memory budget: the configured one, else half of the device's
    memory left after the weights."""
    if cfg.kv_memory_bytes is not None:
        return cfg.kv_memory_bytes
    return max(0, (device_memory_bytes() - info.weights_bytes) // 2)


def _kv_cache_manager(cfg: EngineConfig, info: ModelInfo) -> KVCacheManager:
    """The kv_cache actor for the loaded model: its budget and whether its cache takes part."""
    support = info.cache_support or SnapshotSupport(False, False, "not probed", ())
    return KVCacheManager.for_model(
        cfg.cache_memory_bytes,
        support,
        weights_bytes=info.weights_bytes,
        exact_prompt_limit=info.exact_prompt_limit,
    )


#: engines serving with `freeze_gc` in this process (`_frozen_gc`), under its lock
_freezers = 0
_freezers_lock = threading.Lock()


@contextmanager
def _frozen_gc(freeze: bool) -> Iterator[None]:
    """With `freeze` (`EngineConfig.freeze_gc`), the objects alive once the model is loaded go
    to the cyclic collector's permanent generation while the engine serves (`gc.freeze`), so
    its full passes, which stop every thread, scan only what requests create. The last such
    engine to close puts them back (`gc.unfreeze` thaws everything frozen, so not while
    another engine of the process still serves frozen)."""
    global _freezers
    if not freeze:
        yield
        return
    gc.collect()
    gc.freeze()
    with _freezers_lock:
        _freezers += 1
    try:
        yield
    finally:
        with _freezers_lock:
            _freezers -= 1
            if not _freezers:
                gc.unfreeze()


@contextmanager
def _gil_switch_interval(interval: float | None) -> Iterator[None]:
    """Lower Python's thread switch interval while the engine runs (only when asked:
    `EngineConfig.gil_switch_interval`).

    The runner thread holds the GIL while it builds each step's graph; with CPython's default
    5 ms interval, a token handed to the Trio thread can wait that long for the GIL. A short
    interval lets the event loop take each token as soon as it is ready (measured on the tiny
    model: first-token delivery 1.8 ms -> 0.2 ms). Process-wide, so it is put back on exit
    unless someone else changed it meanwhile.
    """
    if interval is None or interval >= sys.getswitchinterval():
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        if sys.getswitchinterval() == interval:
            sys.setswitchinterval(previous)


@asynccontextmanager
async def open_engine(
    model: str | Path | None = None,
    *,
    loader: ModelLoader = load_model,
    **config: Any,
) -> AsyncIterator[Engine]:
    """Open an engine for the duration of the block::

        async with trio_mlx.open_engine() as engine:      # the bundled SmolLM2-135M-Instruct
            print(await engine.chat([{"role": "user", "content": "Hi"}], max_tokens=16))

    Raises the load error if the model cannot be loaded, and `EngineCrashed` on exit if the runner
    thread died while the block ran.
    """
    failure: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            engine: Engine = await nursery.start(
                partial(serve_engine, model, loader=loader, **config)
            )
        except (Exception, KeyboardInterrupt, SystemExit) as exc:
            # The model did not load (or Ctrl-C came meanwhile): nothing else is running yet.
            failure = exc
        else:
            try:
                yield engine
            except (Exception, KeyboardInterrupt, SystemExit) as exc:
                # The caller's own error: re-raised as it is once the engine has stopped, rather
                # than wrapped in this nursery's ExceptionGroup. Ctrl-C (KeyboardInterrupt in
                # the main task, most likely while it waits inside this block) and sys.exit()
                # too, so that `except KeyboardInterrupt` still catches them. Cancellation goes
                # through the nursery as Trio expects.
                failure = exc
            finally:
                engine.close()
                nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    crash = engine.crash
    if crash is not None:
        raise EngineCrashed(f"the engine crashed: {crash}") from crash
