"""`GET /metrics`: Prometheus text exposition, names in the `trio_mlx:` namespace mirroring vLLM's.

Request metrics are observed once per generation request when its HTTP exchange ends (the access
log's record): time to first token, the request's mean inter-token latency, end-to-end latency,
prompt and generated tokens, and how it ended: `request_success_total{finished_reason}` counts
only requests that generated to their end (`stop`, `length`); `request_aborted_total` and
`request_failed_total` count the others. Gauges (running, waiting) and the prefix-cache counters
are read from the engine at scrape time.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from typing import Any

from trio_mlx.http.access_log import RequestRecord

PREFIX = "trio_mlx:"
#: Finish reasons that are not a success: counted by their own metrics.
UNSUCCESSFUL = frozenset({"abort", "error"})

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
)


class Histogram:
    """Cumulative-bucket histogram in Prometheus' sense."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = []
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            out.append(f'{name}_bucket{{{labels},le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    """The server's request metrics. Updated and read on the Trio thread only."""

    def __init__(self) -> None:
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()

    def observe(self, record: RequestRecord, elapsed: float) -> None:
        """One generation request ended after `elapsed` seconds (no-op for other requests)."""
        if record.finish_reason is None:
            return
        self.finished[record.finish_reason] += 1
        self.prompt_tokens += record.prompt_tokens or 0
        generated = record.completion_tokens or 0
        self.generation_tokens += generated
        self.e2e.observe(elapsed)
        ttft = record.time_to_first_token
        if ttft is not None:
            self.ttft.observe(ttft)
            if generated > 1:
                self.itl.observe(max(0.0, elapsed - ttft) / (generated - 1))

    def render(self, model: str, stats: dict[str, Any] | None, cache: dict[str, Any] | None) -> str:
        """The exposition text; `stats` / `cache` are the engine's (None while loading)."""
        labels = f'model_name="{_escape(model)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[str]) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            lines.extend(samples)

        def sample(name: str, value: float, extra: str = "") -> str:
            return f"{PREFIX}{name}{{{labels}{extra}}} {value:g}"

        if stats is not None:
            metric(
                "num_requests_running",
                "gauge",
                "Requests generating now.",
                [sample("num_requests_running", stats["running"])],
            )
            metric(
                "num_requests_waiting",
                "gauge",
                "Requests queued for admission.",
                [sample("num_requests_waiting", stats["waiting"])],
            )
            metric(
                "request_rejected_total",
                "counter",
                "Requests refused by admission (429).",
                [sample("request_rejected_total", stats["busy_rejections"])],
            )
            runner = stats.get("runner", {})
            metric(
                "num_sequences_decoding",
                "gauge",
                "Sequences in the decode batch now.",
                [sample("num_sequences_decoding", runner.get("decoding", 0))],
            )
            metric(
                "num_sequences_prefilling",
                "gauge",
                "Admitted sequences prefilling to join the batch.",
                [sample("num_sequences_prefilling", runner.get("prefilling", 0))],
            )
            metric(
                "decode_steps_by_batch_size_total",
                "counter",
                "Batched decode steps by the number of sequences in them.",
                [
                    sample("decode_steps_by_batch_size_total", n, f',batch_size="{size}"')
                    for size, n in runner.get("batch_sizes", {}).items()
                ],
            )
            metric(
                "tokens_per_step",
                "gauge",
                "Prompt and generated tokens per runner step, on average.",
                [sample("tokens_per_step", runner.get("tokens_per_step", 0.0))],
            )
            metric(
                "kv_cache_bytes",
                "gauge",
                "Memory of the live sequences' KV caches.",
                [sample("kv_cache_bytes", runner.get("kv_bytes", 0))],
            )
            if stats.get("multimodal"):
                metric(
                    "num_sequences_media",
                    "gauge",
                    "Requests with media stepping beside the decode batch (vision step, prefill).",
                    [sample("num_sequences_media", runner.get("media_sequences", 0))],
                )
                metric(
                    "media_joined_total",
                    "counter",
                    "Requests with media that joined the decode batch after their prefill.",
                    [sample("media_joined_total", runner.get("media_joined", 0))],
                )
            speculative = stats.get("speculative")
            if speculative:
                for name, key, help in (
                    ("spec_decode_num_drafts_total", "speculative_steps", "Verification passes."),
                    (
                        "spec_decode_num_draft_tokens_total",
                        "drafted_tokens",
                        "Tokens proposed by the draft model.",
                    ),
                    (
                        "spec_decode_num_accepted_tokens_total",
                        "accepted_tokens",
                        "Drafted tokens the target kept.",
                    ),
                ):
                    metric(name, "counter", help, [sample(name, speculative.get(key, 0))])
                metric(
                    "spec_decode_acceptance_rate",
                    "gauge",
                    "Accepted over drafted tokens since the engine started.",
                    [sample("spec_decode_acceptance_rate", speculative.get("acceptance_rate", 0))],
                )
            metric(
                "kv_reserved_bytes",
                "gauge",
                "KV memory reserved by admission: running requests at their token limits.",
                [sample("kv_reserved_bytes", stats.get("kv_reserved_bytes", 0))],
            )
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            [sample("prompt_tokens_total", self.prompt_tokens)],
        )
        metric(
            "generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            [sample("generation_tokens_total", self.generation_tokens)],
        )
        metric(
            "request_success_total",
            "counter",
            "Requests that generated to their end, by finish reason (stop, length).",
            [
                sample("request_success_total", n, f',finished_reason="{_escape(reason)}"')
                for reason, n in sorted(self.finished.items())
                if reason not in UNSUCCESSFUL
            ],
        )
        metric(
            "request_aborted_total",
            "counter",
            "Requests ended before their end: the client went away, or the server shut down.",
            [sample("request_aborted_total", self.finished["abort"])],
        )
        metric(
            "request_failed_total",
            "counter",
            "Requests whose generation failed (a model or decoding error).",
            [sample("request_failed_total", self.finished["error"])],
        )
        for name, hist, help in (
            ("time_to_first_token_seconds", self.ttft, "Time to first token."),
            ("inter_token_latency_seconds", self.itl, "Mean inter-token latency per request."),
            ("e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
        ):
            metric(name, "histogram", help, hist.lines(PREFIX + name, labels))
        if cache and cache.get("enabled"):
            hits, misses = cache.get("hits", 0), cache.get("misses", 0)
            metric(
                "prefix_cache_queries_total",
                "counter",
                "Prefix cache lookups.",
                [sample("prefix_cache_queries_total", hits + misses)],
            )
            metric(
                "prefix_cache_hits_total",
                "counter",
                "Prefix cache hits.",
                [sample("prefix_cache_hits_total", hits)],
            )
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
