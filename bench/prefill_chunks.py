"""Where a prefill chunk's time goes while a batch decodes: cold and warm shapes, plain and padded
attention.

    python -m bench.prefill_chunks --model synthetic:llama-8b-bf16 --out FILE.json       # H200
    python -m bench.prefill_chunks --model synthetic:llama-1b-fp32 --prompt-tokens 512 \\
        --chunks 64,128 --batch 2 --context 64                                           # CPU

The engine's batched route interleaves one decode step of the running rows with one chunk of a
long prompt's prefill (`actors/batch_loop.py`); issue 16 asks that the running streams'
inter-token gap stays within 3x its plain value meanwhile. This bench times the two passes
apart, with the model alone (no engine, no event loop): per `--chunks` size c and variant, the
prompt (`--prompt-tokens` random ids) is prefilled twice on fresh caches, a decode step of a
`--batch`-row `BatchKVCache` of `--context` positions between every two chunks, each pass
evaluated and timed on its own:

- `plain`: `model(chunk, cache=cache)` on mlx-lm's `KVCache`, as the engine's chunks run now:
  every chunk's attention has a new key length (on MLX's CUDA backend cuDNN builds a graph per
  new (query, key) length pair, `engine/mlx_cuda.py`);
- `padded`: the prompt's cache reserved up front to the prompt length rounded up to
  `--width-block` positions, and every chunk's attention over that whole buffer with a mask
  (`padded_attention.padded_forward`): one (query, key) pair per chunk size and width;
- `bucketed`: as the engine's batched route on CUDA runs them (`engine/prefill_shapes.py`): the
  first chunk plain, then each chunk over the cache grown to its width bucket (`key_width`);
- `mixed`: each chunk (bucketed, as above) in the decode step's own forward pass
  (`engine/mixed_step.py`, `TRIO_MLX_MIXED_STEP=on`): one pass a step, timed as the step.

The first pass over the prompt is `cold` (shapes new to this process, for that variant and
size; with `--warm`, after `prefill_shapes.warm_graphs` as the engine runs it when its batch
starts, so what a first long prompt meets there), the second `warm` (every shape seen once).
As on the engine's batched route, the attention dispatcher is installed (`decode_attention`:
padded chunks attend through their views' `attend`). Reported per (variant, c, pass): the chunk's
time p50 / p90 / max, its sum (the prompt's prefill time), the decode step's p50 / max beside
it, and the gap the running rows see (chunk and step, or the mixed pass) p50 / max; plus the
decode step alone before any chunk, the reference for a gap. Random weights: speed only.
The process's MLX cache limit is the batched route's (`BATCH_CACHE_LIMIT`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from bench.compiled_decode import build_synthetic
from bench.quantized_rows import activation_dtype, batch_cache
from mlx_lm.models.cache import KVCache, make_prompt_cache

from trio_mlx.actors.batch_loop import BATCH_CACHE_LIMIT
from trio_mlx.engine import mixed_step
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.compiled_step import COMPILABLE_MODULES
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.decode_attention import install_dispatcher
from trio_mlx.engine.mlx_cuda import keep_attention_graphs
from trio_mlx.engine.padded_attention import padded_forward
from trio_mlx.engine.prefill_shapes import key_width, reserve, warm_graphs
from trio_mlx.types import SamplingParams


def timed(fn: Any) -> float:
    began = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - began


def decode_step(model: Any, cache: list[Any], tokens: Any) -> float:
    """One bare batched step (argmax of the last logits), then the cache trimmed back."""
    seconds = timed(lambda: mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1))
    for layer in cache:
        layer.trim(1)
    return seconds


def reserved_cache(model: Any, width: int) -> list[Any]:
    """A fresh prompt cache whose every layer already holds a `width`-position buffer (offset
    0): chunks write into it and never grow it."""
    cache = make_prompt_cache(model)
    args = model.args
    heads = args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = activation_dtype(model)
    for layer in cache:
        assert type(layer) is KVCache
        layer.keys = mx.zeros((1, heads, width, head_dim), dtype=dtype)
        layer.values = mx.zeros((1, heads, width, head_dim), dtype=dtype)
        layer.offset = 0
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    return cache


def mixed_pass(
    model: Any, prompt: Any, size: int, batch: list[Any], step_tokens: Any
) -> tuple[list[float], list[float]]:
    """The prompt's chunks (bucketed, rungs of `size`) each in a decode step's pass: no chunk
    time of its own, the pass's time as the step's."""
    tokens = (*(int(t) for t in prompt.tolist()), 0)  # ready once all of it is in
    job = GenerationJob(1, tokens, SamplingParams(max_tokens=1))
    seq = BatchSequence(
        job,
        model,
        vocab_size=int(model.args.vocab_size),
        plan=PrefillPlan(size, tail=min(64, size), block=min(64, size)),
        max_kv_size=None,
        cache=None,
        cached_tokens=0,
        split_at_store_points=False,
        padded=True,
    )
    inputs = step_tokens[:, 0]
    steps: list[float] = []
    while not seq.ready:

        def step() -> Any:
            logits, _ = mixed_step.forward(model, inputs, batch, [mixed_step.plan(seq, size)])
            return [mx.argmax(logits, axis=-1), *(c.state for c in seq.cache)]

        steps.append(timed(step))
        for layer in batch:
            layer.trim(1)
    return [0.0] * len(steps), steps


def one_pass(
    model: Any, variant: str, prompt: Any, size: int, width: int, batch: list[Any], step_tokens: Any
) -> dict[str, Any]:
    if variant == "mixed":
        chunks, steps = mixed_pass(model, prompt, size, batch, step_tokens)
        return summary(chunks, steps)
    cache = reserved_cache(model, width) if variant == "padded" else make_prompt_cache(model)
    keys = 0
    chunks: list[float] = []
    steps: list[float] = []
    total = int(prompt.shape[0])
    for start in range(0, total, size):
        chunk = prompt[start : start + size][None]
        keys += int(chunk.shape[1])
        if variant == "padded" or (variant == "bucketed" and reserve(cache, key_width(keys))):
            chunks.append(timed(lambda c=chunk: padded_forward(model, c, cache)[:, -1, :]))
        else:
            chunks.append(timed(lambda c=chunk: model(c, cache=cache)[:, -1, :]))
        steps.append(decode_step(model, batch, step_tokens))
    return summary(chunks, steps)


def summary(chunks: list[float], steps: list[float]) -> dict[str, Any]:
    ordered = sorted(chunks)
    gaps = [c + s for c, s in zip(chunks, steps, strict=True)]
    return {
        "chunks": len(chunks),
        "chunk_p50_ms": 1e3 * statistics.median(chunks),
        "chunk_p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "chunk_max_ms": 1e3 * max(chunks),
        "prefill_s": sum(gaps) - sum(steps) if any(chunks) else sum(steps),
        "step_p50_ms": 1e3 * statistics.median(steps),
        "step_max_ms": 1e3 * max(steps),
        "gap_p50_ms": 1e3 * statistics.median(gaps),
        "gap_max_ms": 1e3 * max(gaps),
    }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:llama-1b-bf16")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--chunks", default="128,256,512")
    parser.add_argument("--variants", default="plain,padded,bucketed,mixed")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--width-block", type=int, default=1024)
    parser.add_argument(
        "--warm", action="store_true", help="warm_graphs first, as the engine at its start"
    )
    parser.add_argument("--deadline-s", type=float, default=400.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    keep_attention_graphs()  # as a server process does (`SERVER_PROCESS_SETTINGS`)
    mx.set_cache_limit(BATCH_CACHE_LIMIT)
    name = args.model.removeprefix("synthetic:")
    model = build_synthetic(name)
    if "mixed" in args.variants.split(",") and not mixed_step.prepare(model):
        parser.error(f"{name} cannot take mixed passes (engine/mixed_step.py)")
    install_dispatcher(COMPILABLE_MODULES)
    sizes = [int(c) for c in args.chunks.split(",")]
    warmed = warm_graphs(model, min(64, *sizes), max(sizes)) if args.warm else 0
    batch = batch_cache(model, args.batch, args.context)
    step_tokens = mx.zeros((args.batch, 1), dtype=mx.uint32)
    for _ in range(3):
        decode_step(model, batch, step_tokens)
    alone = [decode_step(model, batch, step_tokens) for _ in range(20)]
    mx.random.seed(1)
    prompt = mx.random.randint(100, 40_000, (args.prompt_tokens,)).astype(mx.uint32)
    width = -(-args.prompt_tokens // args.width_block) * args.width_block
    report: dict[str, Any] = {
        "command": " ".join(["python -m bench.prefill_chunks", *argv]),
        "model": args.model,
        "device": str(mx.default_device()),
        "host": platform.node(),
        "batch": args.batch,
        "context": args.context,
        "prompt_tokens": args.prompt_tokens,
        "width": width,
        "step_alone_p50_ms": 1e3 * statistics.median(alone),
        "warmed_attentions": warmed,
        "runs": [],
        "skipped": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    for size in sizes:
        for variant in args.variants.split(","):
            for which in ("cold", "warm"):
                if time.perf_counter() - began > args.deadline_s:
                    report["skipped"].append([variant, size, which])
                    continue
                run = {"variant": variant, "chunk": size, "pass": which}
                run.update(one_pass(model, variant, prompt, size, width, batch, step_tokens))
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
