"""The batching ceiling: one bare batched decode step through mlx-lm's model code, at each batch
size, and what it would deliver (B ÷ step time), next to trio-mlx's own `BatchDecoder` step.

    python -m bench.batch_ceiling --model synthetic:llama-1b-bf16 --batch 1,4,16,64 --out FILE

For each B: B sequences, each with a `--context`-token KV cache (mlx-lm's `BatchKVCache`), then
`--steps` decode steps, each `mx.eval`'d (the "bare" figure: no pipelining, no sampling but an
argmax), and the same number of `BatchDecoder.decode()` calls (trio-mlx's batch: per-sequence
selectors, pipelined), plain, with fused projections alone (`fused_decoder_*`: the GPU's
default) and with `compiled_decode` (fused projections and the traced batch step:
`compiled_decoder_*`), and with the lean step at every size (fused projections, a lone row's
`LeanStep.logits` and a batch's `LeanStep.batch_logits`, `TRIO_MLX_LEAN_BATCH=on`:
`lean_decoder_*`). Aggregate tok/s = B ÷ median step time. The bare figure is the ceiling
that the HTTP figures are held against; the decoder figure says what the batch machinery costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.models import resolve_subject


def bare_steps(model: Any, batch: int, context: int, steps: int) -> list[float]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    caches = []
    for _ in range(batch):
        cache = make_prompt_cache(model)
        model(mx.zeros((1, context), dtype=mx.uint32), cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    merged = [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    tokens = mx.zeros((batch,), dtype=mx.uint32)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        logits = model(tokens[:, None], cache=merged)[:, -1, :]
        tokens = mx.argmax(logits, -1).astype(mx.uint32)
        mx.eval(tokens)
        times.append(time.perf_counter() - began)
    return times


def decoder_steps(
    model: Any,
    batch: int,
    context: int,
    steps: int,
    vocab: int,
    compiled: Any = None,
    lean: Any = None,
) -> list[float]:
    import mlx.core as mx

    from trio_mlx.engine.batch import BatchDecoder
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.types import SamplingParams

    decoder = BatchDecoder(
        model, frozenset(), vocab_size=vocab, plan=PrefillPlan(4096), compiled=compiled, lean=lean
    )
    params = SamplingParams(max_tokens=10**6, temperature=0.0)
    for i in range(batch):
        decoder.add(GenerationJob(i, tuple([1] * (context + 1)), params), None, 0)
    while decoder.waiting:
        decoder.prefill(10**9, 10**9)
        decoder.join()
    times = []
    for _ in range(steps + 2):
        began = time.perf_counter()
        decoder.decode()
        times.append(time.perf_counter() - began)
    mx.eval(mx.zeros(1))
    return times[2:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_ceiling", description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", default="/tmp/trio-mlx-compare")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)

    import mlx.core as mx
    import mlx_lm

    subject = resolve_subject(args.model, Path(args.workdir))
    model, _tokenizer = mlx_lm.load(str(subject.path))
    vocab = int(model.args.vocab_size)
    from bench.models import structural_copy

    from trio_mlx.engine.compiled_step import CompiledDecode
    from trio_mlx.engine.fused import fuse_projections

    fused = structural_copy(model)  # raw mlx-lm's arrays, projections fused in the copy only
    fuse_projections(fused)
    compiled = CompiledDecode(fused, attention_kernel=False)
    from trio_mlx.engine.lean_step import LeanStep

    lean = LeanStep(fused)
    os.environ["TRIO_MLX_LEAN_BATCH"] = "on"  # the lean step at every batch size
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        bare_steps(model, batch, args.context, 3)  # compile this shape's kernels
        bare = statistics.median(bare_steps(model, batch, args.context, args.steps))
        ours = statistics.median(decoder_steps(model, batch, args.context, args.steps, vocab))
        fused_plain = statistics.median(
            decoder_steps(fused, batch, args.context, args.steps, vocab)
        )
        traced = statistics.median(
            decoder_steps(fused, batch, args.context, args.steps, vocab, compiled)
        )
        leaner = statistics.median(
            decoder_steps(fused, batch, args.context, args.steps, vocab, lean=lean)
        )
        row = {
            "batch": batch,
            "bare_step_ms": bare * 1e3,
            "bare_tok_s": batch / bare,
            "decoder_step_ms": ours * 1e3,
            "decoder_tok_s": batch / ours,
            "fused_decoder_step_ms": fused_plain * 1e3,
            "fused_decoder_tok_s": batch / fused_plain,
            "compiled_decoder_step_ms": traced * 1e3,
            "compiled_decoder_tok_s": batch / traced,
            "lean_decoder_step_ms": leaner * 1e3,
            "lean_decoder_tok_s": batch / leaner,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        mx.clear_cache()
    report = {
        "model": args.model,
        "description": subject.description,
        "device": str(mx.default_device()),
        "context": args.context,
        "steps": args.steps,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
