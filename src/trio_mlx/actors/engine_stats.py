"""The engine's statistics: the JSON-serialisable snapshots `Engine.get_stats()` and
`Engine.get_cache_stats()` return (their docstrings list the keys; `/v1/stats` and the metrics
serve them), and the tally of finished requests they report.

Assembly only: each function reads counters that their owners write (the runner thread's plain
ints, the admission book's and the prefix-cache book's snapshots, the speculator's and
SpecPrefill's counters) and changes nothing; call it from the Trio thread. `FinishedRequests` is
written on the Trio thread, when a request's stream closes.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from trio_mlx.actors.admission import AdmissionController
from trio_mlx.actors.kv_cache_manager import KVCacheManager
from trio_mlx.actors.model_info import ModelInfo
from trio_mlx.actors.runner import Runner
from trio_mlx.actors.stream import RequestStream
from trio_mlx.config import EngineConfig
from trio_mlx.engine.self_draft import describe_layers
from trio_mlx.types import GenerationOutput


class FinishedRequests:
    """The requests that have ended, by finish reason (`"abort"` for one that ended without a
    final output), and the last final output (for `last_request`)."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self.last: GenerationOutput | None = None

    def record(self, stream: RequestStream | None) -> None:
        """Count `stream`'s end (nothing when the request never got a stream)."""
        if stream is None:
            return
        final = stream.final
        reason = final.finish_reason if final is not None else "abort"
        self.by_reason[reason or "abort"] += 1
        if final is not None:
            self.last = final


def cache_stats(kv_cache: KVCacheManager, runner: Runner) -> dict[str, Any]:
    """The prefix KV cache: the book's statistics and the runner's snapshot counters (see
    `Engine.get_cache_stats`)."""
    stats = kv_cache.statistics()
    counters = runner.snapshot_counters
    stats.update(
        snapshots_held=counters.snapshots_held,
        snapshots_taken=counters.snapshots_taken,
        snapshot_seconds=counters.snapshot_seconds,
        snapshot_failures=counters.snapshot_failures,
        restores=counters.restores,
    )
    return stats


def engine_stats(
    *,
    config: EngineConfig,
    info: ModelInfo,
    runner: Runner,
    admission: AdmissionController,
    kv_cache: KVCacheManager,
    finished: FinishedRequests,
    alive: bool,
    started_at: float,
    preparing: int = 0,
) -> dict[str, Any]:
    """A snapshot of the whole engine (see `Engine.get_stats`); `started_at` is the engine's
    start on `time.monotonic()`'s clock."""
    book = admission.book.statistics()
    counters = runner.counters
    last = finished.last
    speculation = speculative_stats(config, runner)
    return {
        "model_name": info.name,
        "alive": alive,
        "uptime_s": time.monotonic() - started_at,
        "admission_mode": book.mode,
        "running": book.running,
        "waiting": book.waiting,
        "max_waiting": book.max_waiting,
        "admitted": book.admitted,
        "busy_rejections": book.busy_rejections,
        "wait_timeouts": book.wait_timeouts,
        "slot_holders": [{"request_id": rid, "held_s": held} for rid, held in book.holders.items()],
        "max_num_seqs": book.slots,
        "kv_reserved_bytes": book.kv_reserved_bytes,
        "kv_budget_bytes": book.kv_budget_bytes,
        "memory_waits": book.memory_waits,
        "preparing": preparing,
        "finished": dict(finished.by_reason),
        "runner": {
            "batching": runner.batching,
            "decoding": counters.decoding,
            "prefilling": counters.prefilling,
            "batch_sizes": {str(k): v for k, v in sorted(counters.batch_sizes.items())},
            "tokens_per_step": (counters.prompt_tokens + counters.generated_tokens) / counters.steps
            if counters.steps
            else 0.0,
            "kv_bytes": counters.kv_bytes,
            "media_sequences": counters.media,
            "media_steps": counters.media_steps,
            "media_drafted": counters.media_drafted,
            "media_joined": counters.media_joined,
            "slowest_recent_step": counters.slowest_recent_step(),
            "steps": counters.steps,
            "prefill_chunks": counters.prefill_chunks,
            "prefill_groups": counters.prefill_groups,
            "grouped_prefills": counters.grouped_prefills,
            "prefill_group_failures": counters.prefill_group_failures,
            "grouped_attention_steps": counters.grouped_attention_steps,
            "segmented_steps": counters.segmented_steps,
            "traced_steps": counters.traced_steps,
            "deferred_dispatches": counters.deferred_dispatches,
            "deferred_joins": counters.deferred_joins,
            "mixed_chunks": counters.mixed_chunks,
            "arriving": runner.arriving,
            "burst_holds": counters.burst_holds,
            "burst_hold_s": counters.burst_hold_seconds,
            "decode_steps": counters.decode_steps,
            "prompt_tokens": counters.prompt_tokens,
            "generated_tokens": counters.generated_tokens,
            "live_sequences": counters.live,
            "requests_in_flight": runner.in_flight,
            "started": counters.started,
            "aborted": counters.aborted,
            "failed": counters.failed,
            "busy_s": counters.busy_seconds,
        },
        "cache": cache_stats(kv_cache, runner),
        "vision_cache": runner.vision_cache.statistics(),
        "multimodal": info.multimodal is not None,
        "acceptance_rate": None if speculation is None else speculation["acceptance_rate"],
        "speculative": speculation,
        "specprefill": specprefill_stats(runner),
        "last_request": None
        if last is None
        else {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "finish_reason": last.finish_reason,
            "time_to_first_token_s": last.time_to_first_token,
            "generation_tps": last.generation_tps,
        },
    }


def _drafter_name(config: EngineConfig) -> str:
    if config.mtp:
        return "mtp"
    if config.draft_layers is not None:
        return f"self:{describe_layers(config.draft_layers)}"  # the target's own layers
    return str(config.draft_model)


def speculative_stats(config: EngineConfig, runner: Runner) -> dict[str, Any] | None:
    """Speculative decoding's drafter, draft length and counters (None without a drafter)."""
    speculator = runner.speculator
    if speculator is None:
        return None
    return {
        "draft_model": _drafter_name(config),
        "num_draft_tokens": speculator.num_draft_tokens,
        **speculator.counters.statistics(),
    }


def specprefill_stats(runner: Runner) -> dict[str, Any] | None:
    """SpecPrefill's settings and counters (None when no scoring model is loaded)."""
    if runner.scorer is None:
        return None
    settings = runner.specprefill
    return {
        "enabled": settings.enabled,
        "threshold": settings.threshold,
        "keep_pct": settings.keep_pct,
        "backbone_pct": settings.backbone_pct,
        "route": "batched: full prefill" if runner.batching else "serialized",
        **runner.specprefill_counters.statistics(),
    }
