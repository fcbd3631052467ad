"""Time to first token of the engine by fused prompt tail (`fused_tail_tokens`), one engine per
tail size, on the same token prompts (a profiling instrument for choosing the default).

    python -m bench.fused_tail --model synthetic:llama-1b-bf16 --tails default,256,512,1024

For each tail (`default`: the engine's own choice) and each prompt length: `--warmup` prompts of
that length first (on MLX's CUDA backend every new attention shape builds a cuDNN graph), then the
median of `--repeats` others. Token-id prompts, prefix cache off, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from bench.hot_path import no_eos_loader
from bench.models import resolve_subject

import trio_mlx
from trio_mlx.config import SERVER_PROCESS_SETTINGS


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def ttft_ms(engine: trio_mlx.Engine, ids: list[int]) -> float:
    start = time.perf_counter()
    async for out in engine.stream_generate(ids, max_tokens=2, temperature=0.0):
        if out.new_tokens:
            return (time.perf_counter() - start) * 1e3
    raise AssertionError("no token")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    path = resolve_subject(args.model, Path(args.workdir)).path
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict[str, Any] = {"model": args.model, "device": str(mx.default_device()), "ms": {}}
    for tail_arg in args.tails.split(","):
        tail = None if tail_arg == "default" else int(tail_arg)
        async with trio_mlx.open_engine(
            path,
            loader=no_eos_loader,
            cache_memory_bytes=0,
            fused_tail_tokens=tail,
            **SERVER_PROCESS_SETTINGS,
        ) as engine:
            for n in lengths:
                for seed in range(args.warmup):
                    await ttft_ms(engine, prompt(n, seed))
                times = [await ttft_ms(engine, prompt(n, 1000 + s)) for s in range(args.repeats)]
                key = f"{tail_arg}/{n}"
                results["ms"][key] = round(statistics.median(times), 1)
                print(key, results["ms"][key], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tails", default="default,256,512,1024")
    parser.add_argument("--lengths", default="138,300,500,1000,2058")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--json", default=None)
    trio.run(main, parser.parse_args())
