"""Rows joining and leaving the batch cache, model-free: trio-mlx's `engine/batch_layout.py`
against mlx-lm's own `BatchKVCache.extend` / `filter`, on buffers of a real shape.

    python -m bench.batch_rows --shape 8b --out $OUT/batch-rows-8b.json      # on the H200
    python -m bench.batch_rows --shape cpu --repeats 5                      # on this CPU

Per repeat, alternating the two ways, fresh buffers each time (random bf16/fp16 keys/values of
every layer):
- `join`: `--rows` rows of `--short` cached positions decoding, one row of `--long` positions
  joins (issue 16's long arrival); timed: the join and the next decode step's cache update, with
  the device synchronised before and after (mlx-lm: `extend` of the merged joiner, whose next
  `update_and_fetch` grows the buffer by a concatenation; trio-mlx: one buffer with room);
- `leave`: device work is queued (`async_eval` of `--work` matmuls, 4096-wide on a GPU, 512 on
  the CPU: milliseconds, about a step's worth), then one row leaves; timed: how long the call
  that drops it takes on the host (mlx-lm's `filter` reads the left padding back, which waits
  for the queued work; trio-mlx's computes it on the host).
Medians of `--repeats`. Shapes: `1b` (16 layers, 8 KV heads of 64), `8b` (32 layers, 8 of 128),
`cpu` (8 layers, 8 of 64, fp16: what this machine holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine import batch_layout

SHAPES = {"1b": (16, 8, 64), "8b": (32, 8, 128), "cpu": (8, 8, 64)}


def _synchronised(fn: Any) -> float:
    mx.synchronize()
    began = time.perf_counter()
    fn()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - began)


def batch(layers: int, heads: int, dims: int, rows: int, length: int, dtype: Any) -> list[Any]:
    out = []
    for _ in range(layers):
        cache = BatchKVCache([0] * rows)
        x = mx.random.normal((rows, heads, length, dims)).astype(dtype)
        cache.update_and_fetch(x, x)
        out.append(cache)
    mx.eval([c.state for c in out])
    return out


def join(way: str, shape: tuple[int, int, int], args: argparse.Namespace, dtype: Any) -> float:
    layers, heads, dims = shape
    rows = batch(layers, heads, dims, args.rows, args.short, dtype)
    longs = []
    for _ in range(layers):
        cache = KVCache()
        y = mx.random.normal((1, heads, args.long, dims)).astype(dtype)
        cache.update_and_fetch(y, y)
        longs.append(cache)
    mx.eval([c.state for c in longs])
    step = mx.zeros((args.rows + 1, heads, 1, dims), dtype)

    def run() -> None:
        if way == "mlx-lm":
            for layer, joining in zip(rows, longs, strict=True):
                layer.extend(KVCache.merge([joining]))
        else:
            batch_layout.extend(rows, [longs])
        for layer in rows:
            mx.eval(layer.update_and_fetch(step, step))

    return _synchronised(run)


def leave(way: str, shape: tuple[int, int, int], args: argparse.Namespace, dtype: Any) -> float:
    layers, heads, dims = shape
    rows = batch(layers, heads, dims, args.rows, args.short, dtype)
    step = mx.zeros((args.rows, heads, 1, dims), dtype)
    for layer in rows:  # the rows' left padding comes out of a lazy computation, as in serving
        layer.update_and_fetch(step, step)
    side = 512 if args.shape == "cpu" else 4096  # a step's worth of device work, roughly
    work = mx.random.normal((side, side)).astype(dtype)
    mx.eval(work)
    queued = work
    for _ in range(args.work):
        queued = queued @ work
    mx.async_eval(queued, *[layer.left_padding for layer in rows])
    keep = list(range(1, args.rows))
    lengths = [args.short + 1] * len(keep)
    began = time.perf_counter()
    if way == "mlx-lm":
        for layer in rows:
            layer.filter(keep)
    else:
        batch_layout.filter_rows(rows, keep, lengths)
    elapsed = 1e3 * (time.perf_counter() - began)
    mx.eval(queued)
    return elapsed


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--short", type=int, default=600)
    parser.add_argument("--long", type=int, default=8000)
    parser.add_argument("--work", type=int, default=8, help="matmuls queued before a leave")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    dtype = mx.float16 if args.shape == "cpu" else mx.bfloat16
    shape = SHAPES[args.shape]
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for way in ("mlx-lm", "trio-mlx"):
            times.setdefault(f"join {way}", []).append(join(way, shape, args, dtype))
            mx.clear_cache()
            times.setdefault(f"leave {way}", []).append(leave(way, shape, args, dtype))
            mx.clear_cache()
    report = {
        "command": " ".join(["python -m bench.batch_rows", *argv]),
        "device": str(mx.default_device()),
        "shape": args.shape,
        "median_ms": {k: statistics.median(v) for k, v in times.items()},
        "runs_ms": times,
    }
    print(json.dumps(report["median_ms"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
