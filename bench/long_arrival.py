"""A long prompt arriving at a busy batch: the running streams' inter-token latency meanwhile.

    python -m bench.long_arrival --models synthetic:llama-1b-bf16,synthetic:llama-8b-bf16 \\
        --streams 16 --prompt-tokens 8192 --json $OUT/long-arrival.json       # on the H200
    python -m bench.long_arrival --models tiny --streams 4 --prompt-tokens 1024 --repeats 1

Issue 16's target: the ITL p99 of running streams while an 8k-token prompt is admitted at most
3x their ITL p50. Through the engine API (in one process, `trio-mlx serve`'s settings, batching
on): `--streams` greedy requests decode (EOS banned by a logit bias, so they run until
cancelled); once each has given `--steady-tokens` tokens, their inter-token gaps are recorded
for `--baseline-s` seconds (the baseline), then a request of `--prompt-tokens` random token ids
arrives (`max_tokens` 1, or `--long-max-tokens`) and the gaps are recorded until its first
token, while it decodes among them (`with_long_*`, with `--long-max-tokens` over 1), and for
`--after-s` seconds after it ended. Reported per repeat: the baseline ITL p50, the ITL p50 /
p99 / max of the running streams while the long prompt prefilled, the ratio p99 during / p50
baseline, the long prompt's time to first token and the prefill chunks it took, the slowest gap
after it ended (its leave) and the batch's KV memory at its largest while it decoded. Gaps are
measured where the tokens arrive (the consumer's task), so they include the event loop's own
delays.
Random weights: speed only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
from bench import chunk_trace
from bench.models import resolve_subject

from trio_mlx.actors.runner_protocol import StepRecord
from trio_mlx.engine.loading import LoadedModel, load_model

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def step_trace(baseline: list[StepRecord], during: list[StepRecord]) -> dict[str, Any]:
    """The runner's steps (`RunnerCounters.recent_steps`) while the long prompt was admitted:
    how many took over 3x the baseline's median step, and the slowest ones (ms: the step, its
    decode, its prefill; then steps since the last join, rows, prompt tokens in a chunk of their
    own, and in the decode pass; with the previous step's prompt tokens in the pass, which a
    pipelined step's wait mostly is)."""
    median = statistics.median(s.seconds for s in baseline) if baseline else float("nan")
    before = {id(s): during[i - 1] if i else None for i, s in enumerate(during)}
    slowest = sorted(during, key=lambda s: s.seconds, reverse=True)[:6]
    return {
        "baseline_step_p50_ms": 1e3 * median,
        "steps_during": len(during),
        "steps_over_3x": sum(s.seconds > 3 * median for s in during),
        "slowest_steps_ms": [
            [
                round(1e3 * s.seconds, 1),
                round(1e3 * s.decode, 1),
                round(1e3 * s.prefill, 1),
                s.since_join,
                s.rows,
                s.prompt_tokens,
                s.mixed_tokens,
                getattr(before[id(s)], "mixed_tokens", None),
            ]
            for s in slowest
        ],
    }


async def one_repeat(loaded: LoadedModel, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS

    options: dict[str, Any] = {
        **SERVER_PROCESS_SETTINGS,
        "max_num_seqs": 64,
        "cache_memory_bytes": 0,
        "admission": "wait",
        "max_waiting": 64,
    }
    ban_eos = {int(t): -100.0 for t in loaded.eos_token_ids}
    arrivals: dict[int, list[float]] = {i: [] for i in range(args.streams)}
    async with trio_mlx.open_engine("model", loader=lambda _spec: loaded, **options) as engine:
        await engine.chat([{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
        steady = trio.Event()

        async def running(i: int) -> None:
            messages = [{"role": "user", "content": f"{PROMPT} Story number {i}."}]
            async for out in engine.stream_chat(
                messages, max_tokens=100_000, temperature=0, logit_bias=ban_eos
            ):
                now = time.perf_counter()
                arrivals[i].extend([now] * max(1, len(out.new_tokens)))
                if all(len(a) >= args.steady_tokens for a in arrivals.values()):
                    steady.set()

        rng = random.Random(seed)
        long_prompt = [rng.randrange(100, 40_000) for _ in range(args.prompt_tokens)]
        result: dict[str, Any] = {}
        with trio.move_on_after(args.deadline_s):
            async with trio.open_nursery() as nursery:
                for i in range(args.streams):
                    nursery.start_soon(running, i)
                await steady.wait()
                baseline_from = time.perf_counter()
                await trio.sleep(args.baseline_s)
                counters = engine._runner.counters
                base_steps = list(counters.recent_steps)
                arrived = time.perf_counter()
                steps_before = counters.steps
                kv_peak = counters.kv_bytes  # the batch's KV memory (`BatchDecoder.kv_bytes`)
                if args.long_max_tokens == 1:
                    out = await engine.generate(long_prompt, max_tokens=1, temperature=0)
                    first = long_done = time.perf_counter()
                    recent = list(counters.recent_steps)
                    during_steps = recent[-(counters.steps - steps_before) :]
                    long_tokens = 1
                else:
                    long_tokens = 0
                    stream = engine.stream_generate(
                        long_prompt,
                        max_tokens=args.long_max_tokens,
                        temperature=0,
                        logit_bias=ban_eos,
                    )
                    async for out in stream:
                        kv_peak = max(kv_peak, counters.kv_bytes)
                        if not long_tokens:
                            first = time.perf_counter()
                            recent = list(counters.recent_steps)
                            during_steps = recent[-(counters.steps - steps_before) :]
                        long_tokens += len(out.new_tokens)
                    long_done = time.perf_counter()
                await trio.sleep(args.after_s)
                ended = time.perf_counter()
                nursery.cancel_scope.cancel()

                def gaps(lo: float, hi: float) -> list[float]:
                    found: list[float] = []
                    for times in arrivals.values():
                        found += [b - a for a, b in itertools.pairwise(times) if lo <= b < hi]
                    return found

                base, during = gaps(baseline_from, arrived), gaps(arrived, first)
                with_long = gaps(first, long_done)
                after = gaps(long_done, ended)
                p50 = statistics.median(base)
                result = {
                    "baseline_itl_p50_ms": 1e3 * p50,
                    "baseline_itl_p99_ms": 1e3 * percentile(base, 0.99),
                    "during_itl_p50_ms": 1e3 * statistics.median(during),
                    "during_itl_p99_ms": 1e3 * percentile(during, 0.99),
                    "during_itl_max_ms": 1e3 * max(during),
                    "p99_during_over_p50_baseline": percentile(during, 0.99) / p50,
                    "with_long_itl_p50_ms": 1e3 * statistics.median(with_long or [0.0]),
                    "with_long_itl_p99_ms": 1e3 * percentile(with_long, 0.99),
                    "long_tokens": long_tokens,
                    # the batch's caches at their largest while the long row decoded in it
                    "kv_gb_peak_with_long": kv_peak / 1e9,
                    "with_long_itl_max_ms": 1e3 * max(with_long or [0.0]),
                    # the long row's leave falls here (its cache's buffers freed)
                    "after_itl_p50_ms": 1e3 * statistics.median(after or [0.0]),
                    "after_itl_max_ms": 1e3 * max(after or [0.0]),
                    "long_prompt_ttft_ms": 1e3 * (first - arrived),
                    "long_prompt_tokens": out.prompt_tokens,
                    "gaps_during": len(during),
                    "prefill_chunks": engine.get_stats()["runner"].get("prefill_chunks"),
                    "slowest_recent_step": engine.get_stats()["runner"]["slowest_recent_step"],
                    **step_trace(base_steps, during_steps),
                }
                if args.trace_chunks:
                    threshold = 3 * result["baseline_step_p50_ms"] / 1e3
                    result["slow_steps"] = chunk_trace.slow_steps(arrived, first, threshold)
    if not result:
        raise SystemExit(f"deadline of {args.deadline_s} s passed before the long prompt ended")
    return result


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="synthetic:llama-1b-bf16,synthetic:llama-8b-bf16")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--steady-tokens", type=int, default=32)
    parser.add_argument("--baseline-s", type=float, default=1.5)
    parser.add_argument("--after-s", type=float, default=0.5)
    parser.add_argument(
        "--long-max-tokens",
        type=int,
        default=1,
        help="tokens the long prompt generates (EOS banned): the running streams' gaps while it "
        "decodes among them are reported as with_long_itl_*",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--trace-chunks",
        action="store_true",
        help="each step over 3x the baseline's median while the long prompt prefilled, with the "
        "chunks it and the step before carried and whether their shapes were new "
        "(bench/chunk_trace.py): slow_steps",
    )
    parser.add_argument(
        "--decode-share",
        type=float,
        default=None,
        help="the pacer's budget for a chunk, in decode steps (default: the engine's)",
    )
    parser.add_argument(
        "--mixed-share",
        type=float,
        default=None,
        help="the same for a chunk in the decode step's pass (TRIO_MLX_MIXED_STEP=on)",
    )
    parser.add_argument("--deadline-s", type=float, default=120.0, help="per repeat")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from trio_mlx.engine import scheduling

    if args.trace_chunks:
        chunk_trace.install()

    if args.decode_share is not None:
        scheduling.DEFAULT_DECODE_SHARE = args.decode_share
    if args.mixed_share is not None:
        scheduling.DEFAULT_MIXED_SHARE = args.mixed_share
    report: dict[str, Any] = {
        "command": " ".join(["python -m bench.long_arrival", *argv]),
        "decode_share": scheduling.DEFAULT_DECODE_SHARE,
        "mixed_share": scheduling.DEFAULT_MIXED_SHARE,
    }
    for spec in args.models.split(","):
        loaded = load_model(resolve_subject(spec, args.workdir).path)
        runs = []
        for repeat in range(args.repeats):
            run = trio.run(one_repeat, loaded, args, repeat)
            runs.append(run)
            print(json.dumps({"model": spec, "repeat": repeat, **run}), flush=True)
        ratios = [r["p99_during_over_p50_baseline"] for r in runs]
        report[spec] = {"runs": runs, "median_ratio": statistics.median(ratios)}
        print(json.dumps({spec: {"median_ratio": report[spec]["median_ratio"]}}), flush=True)
        del loaded
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
