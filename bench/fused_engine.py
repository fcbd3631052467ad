"""Fused projections through the whole engine: decode speed with `fused_projections` on and off.

    python -m bench.fused_engine --models synthetic:llama-1b-bf16,synthetic:llama-8b-bf16 \\
        --json $OUT/fused-engine.json                       # on the H200
    python -m bench.fused_engine --models tiny --tokens 32 --repeats 1   # a CPU smoke run

Per model, two copies are loaded (fusing is done in place at the engine's start): one served
with `fused_projections=False`, one with `True`. Cells, interleaved off/on and repeated
(`--repeats`, the median reported): one greedy chat request on the serialized route
(`max_num_seqs 1`) and on the batched route (`max_num_seqs 64`, a lone row), then
`--streams` concurrent requests on the batched route (aggregate decode tok/s: completion tokens
over the wall time from the first request's start to the last one's end, prefill included).
Random weights: speed only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
from bench.models import resolve_subject

from trio_mlx.engine.loading import LoadedModel, load_model

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


async def cell(
    loaded: LoadedModel, fused: bool, max_num_seqs: int, streams: int, tokens: int
) -> float:
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS

    options: dict[str, Any] = {
        **SERVER_PROCESS_SETTINGS,
        "max_num_seqs": max_num_seqs,
        "cache_memory_bytes": 0,
        "fused_projections": fused,
        "admission": "wait",
        "max_waiting": 256,
    }
    async with trio_mlx.open_engine("model", loader=lambda _spec: loaded, **options) as engine:
        messages = [{"role": "user", "content": PROMPT}]
        await engine.chat(messages, max_tokens=8, temperature=0)  # warm-up
        if streams == 1:
            out = await engine.chat(messages, max_tokens=tokens, temperature=0)
            return float(out.generation_tps or 0.0)
        done: list[int] = []

        async def one(i: int) -> None:
            m = [{"role": "user", "content": f"{PROMPT} Story number {i}."}]
            out = await engine.chat(m, max_tokens=tokens, temperature=0)
            done.append(out.completion_tokens)

        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        return sum(done) / (time.perf_counter() - began)


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="synthetic:llama-1b-bf16,synthetic:llama-8b-bf16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"command": " ".join(["python -m bench.fused_engine", *argv])}
    cells = [
        ("serialized", 1, 1),
        ("batched_lone", 64, 1),
        (f"batched_{args.streams}", 64, args.streams),
    ]
    for spec in args.models.split(","):
        path = resolve_subject(spec, args.workdir).path
        copies = {False: load_model(path), True: load_model(path)}
        rows: dict[str, dict[str, list[float]]] = {
            name: {"off": [], "on": []} for name, _, _ in cells
        }
        for repeat in range(args.repeats):
            for name, seqs, streams in cells:
                order = (False, True) if repeat % 2 == 0 else (True, False)
                for fused in order:
                    tps = trio.run(cell, copies[fused], fused, seqs, streams, args.tokens)
                    rows[name]["on" if fused else "off"].append(tps)
                    print(json.dumps({"model": spec, "cell": name, "fused": fused, "tok_s": tps}))
        summary = {}
        for name, figures in rows.items():
            off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
            summary[name] = {"off_tok_s": off, "on_tok_s": on, "ratio": on / off if off else None}
        report[spec] = {"rows": rows, "summary": summary}
        print(json.dumps({spec: summary}, indent=1))
        del copies
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
