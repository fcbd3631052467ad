"""A burst of requests arriving at once: time to first token with the arrivals prefilled together
in one pass (`engine/batch_prefill.py`) against one pass each.

    python -m bench.burst --models synthetic:llama-1b-bf16,synthetic:llama-8b-bf16 \\
        --streams 16,64 --json $OUT/burst.json                                  # on the H200
    python -m bench.burst --models tiny --streams 8 --repeats 1                 # CPU smoke

Through the engine API in one process (`trio-mlx serve`'s settings, `max_num_seqs` 64, the
prefix cache on as served): per cell, a warm-up burst like the timed one (4 tokens each: its
shapes, the template prefix in the cache), then `N` greedy chats of distinct
~`--prompt-words`-word prompts start together, `--max-tokens` tokens each. Reported: time to
first token p50 / p90 / max over the N (from the burst's start), the aggregate decode rate
(completion tokens over the wall time from the burst's start to the last end), and the prefill
passes the burst took. The two settings (`BatchDecoder.group_prefill` on and off) alternate
cell by cell, the weights loaded once. Random weights: speed only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio
from bench.models import resolve_subject

from trio_mlx.engine.loading import LoadedModel, load_model

WORDS = ["the", "lighthouse", "keeper", "watched", "the", "grey", "sea", "roll", "under", "a"]


def prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
    return f"Request {i}: {body}. Tell me more."


async def burst(loaded: LoadedModel, grouped: bool, streams: int, args: Any) -> dict[str, Any]:
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS
    from trio_mlx.engine.batch import BatchDecoder

    BatchDecoder.group_prefill = grouped
    options: dict[str, Any] = {
        **SERVER_PROCESS_SETTINGS,
        "max_num_seqs": 64,
        "admission": "wait",
        "max_waiting": 256,
    }
    ban = {int(t): -100.0 for t in loaded.eos_token_ids}
    async with trio_mlx.open_engine("model", loader=lambda _spec: loaded, **options) as engine:
        # warm-up: a burst like the timed one (its shapes, the template prefix in the cache)
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                messages = [{"role": "user", "content": prompt(1000 + i, args.prompt_words)}]
                nursery.start_soon(partial(engine.chat, messages, max_tokens=4, temperature=0))
        counters = (
            "prefill_chunks",
            "prefill_groups",
            "grouped_prefills",
            "prefill_group_failures",
        )
        before = {k: engine.get_stats()["runner"][k] for k in counters}
        firsts: list[float] = []
        done: list[int] = []
        began = time.perf_counter()

        async def one(i: int) -> None:
            messages = [{"role": "user", "content": prompt(i, args.prompt_words)}]
            first = None
            last: Any = None
            async for out in engine.stream_chat(
                messages, max_tokens=args.max_tokens, temperature=0, logit_bias=ban
            ):
                if first is None and out.new_tokens:
                    first = time.perf_counter() - began
                last = out
            assert first is not None and last is not None
            firsts.append(first)
            done.append(last.completion_tokens)

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - began
        ordered = sorted(firsts)
        return {
            "ttft_p50_ms": 1e3 * statistics.median(ordered),
            "ttft_p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
            "ttft_max_ms": 1e3 * ordered[-1],
            "aggregate_tok_s": sum(done) / wall,
            **{k: engine.get_stats()["runner"][k] - before[k] for k in counters},
            "pacer": {
                k: getattr(engine._runner.pacer, k)
                for k in ("rate", "overhead", "per_token", "decode_step")
            },
        }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="synthetic:llama-1b-bf16,synthetic:llama-8b-bf16")
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"command": " ".join(["python -m bench.burst", *argv])}
    for spec in args.models.split(","):
        loaded = load_model(resolve_subject(spec, args.workdir).path)
        cells: dict[str, list[dict[str, Any]]] = {}
        for repeat in range(args.repeats):
            for streams in (int(n) for n in args.streams.split(",")):
                order = (True, False) if repeat % 2 == 0 else (False, True)
                for grouped in order:
                    key = f"{streams} {'grouped' if grouped else 'one_each'}"
                    cell = trio.run(burst, loaded, grouped, streams, args)
                    cells.setdefault(key, []).append(cell)
                    print(json.dumps({"model": spec, "cell": key, **cell}), flush=True)
        summary = {
            key: {m: statistics.median(c[m] for c in runs) for m in runs[0] if m != "pacer"}
            for key, runs in cells.items()
        }
        report[spec] = {"cells": cells, "median": summary}
        print(json.dumps({spec: summary}, indent=1), flush=True)
        del loaded
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
