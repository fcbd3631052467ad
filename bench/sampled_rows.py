"""What a decode batch's sampled rows cost the host: the step's graph, rows drawn one by one (each
row's own filters and draw, `BatchChoice.pieces`) against drawn together (`BatchChoice.tokens`:
one sampling pass, `engine/row_sampling.py`), greedy rows for reference.

    python -m bench.sampled_rows --model tiny --rows 1,16,64 --json /tmp/sampled.json

For each batch size, three batches of the same prompts decode on a `BatchDecoder` (the engine's
batched route without the actors): every row greedy, every row sampled (temperature 0.9, top-p
`--top-p`, 1.0 by default as OpenAI's, seeded), and every row sampled with the choice made row
by row. Reported per batch: the operations in one step's graph (what MLX builds and
dispatches; `mx.export_to_dot` of the step's outputs) and the step's median time over
`--steps` steps. On MLX's CPU backend a step computes inside its queuing, so its time is host
and compute together (a sampled row's softmax over the vocabulary is most of it); on a GPU the
host's share is what the operation count drives (docs/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from bench.models import resolve_subject

from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.batch_choice import BatchChoice
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.loading import load_model
from trio_mlx.types import SamplingParams

KINDS = ("greedy", "sampled, together", "sampled, row by row")


def graph_size(*arrays: Any) -> int:
    """The operations in the graph that computes `arrays`."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as out:
        mx.export_to_dot(out.name, *arrays)
        return len(re.findall(r"label =\"[A-Za-z]", Path(out.name).read_text()))


def one_batch(loaded: Any, rows: int, kind: str, steps: int, top_p: float) -> dict[str, Any]:
    batch = BatchDecoder(
        loaded.model,
        frozenset(),
        vocab_size=len(loaded.tokenizer),
        plan=PrefillPlan(256),
        split_at_store_points=False,
    )
    temperature = 0.0 if kind == "greedy" else 0.9
    for i in range(rows):
        prompt = tuple(100 + (7 * i + k) % 900 for k in range(24 + i % 8))
        params = SamplingParams(
            max_tokens=steps + 8, temperature=temperature, top_p=top_p, seed=i, logit_bias=()
        )
        batch.add(GenerationJob(i, prompt, params), None, 0)
    while batch.waiting:
        batch.prefill(1 << 16, 60.0)
        batch.join()
    sizes: list[int] = []
    async_eval = mx.async_eval
    tokens = BatchChoice.tokens

    def spy(*arrays: Any) -> None:
        sizes.append(graph_size(*arrays))
        async_eval(*arrays)

    def row_by_row(
        self: BatchChoice, rows_: Any, logits: Any, spent: frozenset[int] = frozenset()
    ) -> Any:
        pieces, logprobs = self.pieces(rows_, logits, spent=spent)
        return mx.concatenate(pieces), logprobs

    if kind == "sampled, row by row":
        BatchChoice.tokens = row_by_row  # type: ignore[method-assign]
    try:
        batch.decode()  # the first step's shapes
        mx.async_eval = spy
        try:
            batch.decode()  # its graph's size (the step's tokens and logprobs)
        finally:
            mx.async_eval = async_eval
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            batch.decode()
            times.append(time.perf_counter() - began)
    finally:
        BatchChoice.tokens = tokens  # type: ignore[method-assign]
    return {"graph_ops": sizes[-1], "step_ms_p50": 1e3 * statistics.median(times)}


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="the sampled rows' (OpenAI's default)"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    loaded = load_model(resolve_subject(args.model, args.workdir).path)
    report: dict[str, Any] = {
        "command": " ".join(["python -m bench.sampled_rows", *argv]),
        "device": str(mx.default_device()),
        "batches": [],
    }
    for rows in (int(r) for r in args.rows.split(",")):
        for kind in KINDS:
            result = {
                "rows": rows,
                "kind": kind,
                **one_batch(loaded, rows, kind, args.steps, args.top_p),
            }
            report["batches"].append(result)
            print(json.dumps(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
