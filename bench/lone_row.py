"""One stream with batching on against the serialized route: decode speed in back-to-back pairs.

    python -m bench.lone_row --models synthetic:llama-1b-bf16,synthetic:llama-8b-bf16 \\
        --pairs 8 --json $OUT/lone-row.json                    # on the H200
    python -m bench.lone_row --models synthetic:tiny16-fp32 --pairs 4 --tokens 64  # CPU smoke

Issue 16's target: single-stream decode with batching enabled (`max_num_seqs` > 1, the GPU
default) at least 0.97x the serialized route (`max_num_seqs 1`), paired. Per model the weights
are loaded once and both engines are opened on them in turn (settings as `trio-mlx serve`'s:
`SERVER_PROCESS_SETTINGS`, the prefix cache off so that every request prefills alike). A "pair" is
one greedy chat request of `--tokens` tokens on each route, back to back, the order reversed
from pair to pair: the serialized route, the batched route (a lone row on its own cache, as
served), and the batched route with the lone row in a batch cache (`BatchDecoder.solo_rows`
off: what it was before); the ratios are taken within the pair (the host's speed drifts
between minutes on the H200, much less between seconds), then the median and quartiles over
the pairs.
Random weights: speed only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import trio
from bench.models import resolve_subject

from trio_mlx.engine.loading import LoadedModel, load_model

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."

#: route name -> (`max_num_seqs`, `BatchDecoder.solo_rows`)
ROUTES = {"serialized": (1, True), "batched": (64, True), "batch_cache": (64, False)}


async def one_request(
    loaded: LoadedModel, route: tuple[int, bool], tokens: int
) -> dict[str, float]:
    """Open an engine on `loaded`, warm it up, and time one greedy chat of `tokens` tokens."""
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS
    from trio_mlx.engine.batch import BatchDecoder

    max_num_seqs, BatchDecoder.solo_rows = route

    options: dict[str, Any] = {
        **SERVER_PROCESS_SETTINGS,
        "max_num_seqs": max_num_seqs,
        "cache_memory_bytes": 0,
        "admission": "wait",
        "max_waiting": 8,
    }
    async with trio_mlx.open_engine("model", loader=lambda _spec: loaded, **options) as engine:
        messages = [{"role": "user", "content": PROMPT}]
        await engine.chat(messages, max_tokens=16, temperature=0)  # warm-up
        out = await engine.chat(messages, max_tokens=tokens, temperature=0)
        return {
            "decode_tok_s": float(out.generation_tps or 0.0),
            "completion_tokens": out.completion_tokens,
        }


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        v = values[0]
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="synthetic:llama-1b-bf16,synthetic:llama-8b-bf16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"command": " ".join(["python -m bench.lone_row", *argv])}
    for spec in args.models.split(","):
        loaded = load_model(resolve_subject(spec, args.workdir).path)
        pairs: list[dict[str, Any]] = []
        for i in range(args.pairs):
            order = list(ROUTES) if i % 2 == 0 else list(reversed(ROUTES))
            pair: dict[str, Any] = {}
            for name in order:
                pair[name] = trio.run(one_request, loaded, ROUTES[name], args.tokens)
            serialized = pair["serialized"]["decode_tok_s"]
            pair["ratio"] = pair["batched"]["decode_tok_s"] / serialized
            pair["batch_cache_ratio"] = pair["batch_cache"]["decode_tok_s"] / serialized
            pairs.append(pair)
            print(json.dumps({"model": spec, "pair": i, **pair}), flush=True)
        summary = {
            name: statistics.median(p[name]["decode_tok_s"] for p in pairs) for name in ROUTES
        }
        report[spec] = {"pairs": pairs, "median_tok_s": summary}
        for key, label in (("ratio", "batched"), ("batch_cache_ratio", "batch_cache")):
            q1, med, q3 = quartiles([p[key] for p in pairs])
            report[spec][f"{label}_over_serialized"] = {"median": med, "q1": q1, "q3": q3}
        summary_only = {k: v for k, v in report[spec].items() if k != "pairs"}
        print(json.dumps({spec: summary_only}, indent=1), flush=True)
        del loaded
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
