"""SpecPrefill: time to first token on long prompts against full prefill.

    # on the H200 (random weights, the 8B shape scored by the 1B shape):
    python -m bench.specprefill --target synthetic:llama-8b-bf16 --scorer synthetic:llama-1b-bf16 \\
        --lengths 16384 32768 --keep 0.3 --json $OUT/specprefill-8b-1b.json
    # on the CPU, a smoke run:
    python -m bench.specprefill --target tiny --scorer tiny --lengths 2048 --repeats 1

For each prompt length, one engine (the serialized route, `--max-num-seqs 1`, unless a larger
`--max-num-seqs` asks for the batched route; no prefix cache) serves a
random-token prompt with SpecPrefill off (`full`) and on at `--keep` (`specprefill`), interleaved
and repeated (`--repeats`; the median reported), after one warm-up of each at that length. Reported:
time to first token of both, their ratio (the issue's target: <= 0.45 at keep 0.3 and 32k), and
SpecPrefill's split into scoring and sparse prefill seconds (from `get_stats()["specprefill"]`).
Random weights make the kept set meaningless as a quality figure: this measures time only.
Model directories whose context is shorter than the longest prompt are copied (weights linked)
with a longer `max_position_embeddings`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from bench.models import resolve_subject


def with_context(source: Path, out: Path, context: int) -> Path:
    """`source`, or a copy of it whose config allows `context` positions (weights linked)."""
    config = json.loads((source / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= context:
        return source
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        target = out / item.name
        if item.name != "config.json" and not target.exists():
            target.symlink_to(item.resolve())
    config["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def random_prompt(n: int, seed: int) -> list[int]:
    key = mx.random.key(seed)
    return [int(t) for t in mx.random.randint(200, 20000, (n,), key=key).tolist()]


async def measure(
    target: Path, scorer: Path, length: int, keep: float, repeats: int, max_num_seqs: int = 1
) -> dict[str, Any]:
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS

    runs: dict[str, list[float]] = {"full": [], "specprefill": []}
    scoring: list[float] = []
    sparse: list[float] = []
    async with trio_mlx.open_engine(
        target,
        **SERVER_PROCESS_SETTINGS,
        max_num_seqs=max_num_seqs,
        cache_memory_bytes=0,
        specprefill_enabled=True,
        specprefill_threshold=min(8192, length),
        specprefill_keep_pct=keep,
        specprefill_draft_model=scorer,
    ) as engine:
        for i in range(repeats + 1):  # the first round warms up
            for variant in ("full", "specprefill"):
                before = engine.get_stats()["specprefill"]
                out = await engine.generate(
                    random_prompt(length, seed=i),
                    max_tokens=1,
                    temperature=0.0,
                    specprefill=variant == "specprefill",
                )
                after = engine.get_stats()["specprefill"]
                if i == 0:
                    continue
                runs[variant].append(out.time_to_first_token or float("nan"))
                if variant == "specprefill":
                    scoring.append(after["scoring_s"] - before["scoring_s"])
                    sparse.append(after["sparse_prefill_s"] - before["sparse_prefill_s"])
        kept_fraction = engine.get_stats()["specprefill"]["kept_fraction"]
    full = statistics.median(runs["full"])
    spec = statistics.median(runs["specprefill"])
    return {
        "max_num_seqs": max_num_seqs,
        "prompt_tokens": length,
        "keep_pct": keep,
        "kept_fraction": kept_fraction,
        "full_ttft_s": full,
        "specprefill_ttft_s": spec,
        "ratio": spec / full,
        "scoring_s": statistics.median(scoring),
        "sparse_prefill_s": statistics.median(sparse),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="synthetic:llama-8b-bf16")
    parser.add_argument("--scorer", default="synthetic:llama-1b-bf16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--keep", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--max-num-seqs", type=int, default=1, help="1: the serialized route; more: the batched"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.gettempdir()) / "trio-mlx-bench"
    context = max(args.lengths) + 64
    target = resolve_subject(args.target, workdir)
    scorer = resolve_subject(args.scorer, workdir)
    target_dir = with_context(target.path, workdir / "long-target", context)
    scorer_dir = with_context(scorer.path, workdir / "long-scorer", context)
    results = []
    for length in args.lengths:
        row = trio.run(
            measure, target_dir, scorer_dir, length, args.keep, args.repeats, args.max_num_seqs
        )
        results.append(row)
        print(
            f"{length:>6} tokens: full {row['full_ttft_s']:.3f}s, specprefill "
            f"{row['specprefill_ttft_s']:.3f}s (x{row['ratio']:.2f}; scoring "
            f"{row['scoring_s']:.3f}s, sparse prefill {row['sparse_prefill_s']:.3f}s, "
            f"kept {row['kept_fraction']:.2f})",
            flush=True,
        )
    report = {
        "target": target.description,
        "scorer": scorer.description,
        "results": results,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
