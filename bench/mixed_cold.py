"""What a decode pass carrying prefill chunks (`engine/mixed_step.py`) builds anew on a prompt's
first pass: the model alone, passes timed one by one (the mixed variant of `bench.prefill_chunks`).

    python -m bench.mixed_cold --model synthetic:llama-8b-bf16          # on the GPU host

Why: on an H100's 8B bf16 (docs/benchmarks, "Prefill chunks in the decode step's pass") every
mixed step of a prompt's first pass took 67-91 ms at the median, against 25-28 ms on the same
prompt's second pass, where chunks apart were slow only now and then. Each run below is one
prompt's mixed prefill beside a `--batch`-row decode step; per run, its steps' p50 / max and its
first five steps (ms):
- `A`: a first prompt; `B`: another prompt of the same length and chunk size (the same shapes and
  positions, other tokens); `C`: a longer one (positions past A's); `D`: another chunk size;
- `G`, `G2`: a new chunk size with the per-token RoPE off (every token at offset 0: the numerics
  are wrong, the timing tells whether the RoPE is what is built anew); `H`: the same size again
  with it on.
If B is fast and A slow, what is built is keyed by shapes or positions, not tokens; if G is fast
where D was slow, the RoPE with per-token offsets is it. Random weights: speed only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import mlx.core as mx
from bench.compiled_decode import build_synthetic
from bench.prefill_chunks import mixed_pass
from bench.quantized_rows import batch_cache

from trio_mlx.actors.batch_loop import BATCH_CACHE_LIMIT
from trio_mlx.engine import mixed_step, true_positions


def run(model: Any, batch: list[Any], name: str, length: int, size: int, seed: int) -> None:
    mx.random.seed(seed)
    prompt = mx.random.randint(100, 40_000, (length,)).astype(mx.uint32)
    step_tokens = mx.zeros((len_rows(batch), 1), dtype=mx.uint32)
    _, steps = mixed_pass(model, prompt, size, batch, step_tokens)
    ordered = sorted(steps)
    print(
        name,
        f"length {length} chunk {size} steps {len(steps)}",
        f"p50 {1e3 * ordered[len(ordered) // 2]:.1f} ms max {1e3 * ordered[-1]:.1f} ms",
        "first",
        [round(1e3 * s) for s in steps[:5]],
        flush=True,
    )


def len_rows(batch: list[Any]) -> int:
    return int(batch[0].keys.shape[0])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:llama-8b-bf16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    mx.set_cache_limit(BATCH_CACHE_LIMIT)
    model = build_synthetic(args.model.removeprefix("synthetic:"))
    if not mixed_step.prepare(model):
        parser.error("the model cannot take mixed passes")
    batch = batch_cache(model, args.batch, args.context)
    run(model, batch, "A-first", 4096, 128, 1)
    run(model, batch, "B-same-length-new-prompt", 4096, 128, 2)
    run(model, batch, "C-longer", 6144, 128, 3)
    run(model, batch, "D-other-size", 4096, 256, 4)
    positions = true_positions.token_positions
    setattr(true_positions, "token_positions", lambda _: contextlib.nullcontext())  # noqa: B010
    try:
        run(model, batch, "G-no-positioned-rope-new-size", 4096, 512, 5)
        run(model, batch, "G2-no-positioned-rope-again", 4096, 512, 6)
    finally:
        setattr(true_positions, "token_positions", positions)  # noqa: B010
    run(model, batch, "H-positioned-rope-512-after-G", 4096, 512, 7)


if __name__ == "__main__":
    main(sys.argv[1:])
