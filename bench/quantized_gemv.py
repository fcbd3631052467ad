"""One row times a 4-bit weight on the shapes of a model's decode step: MLX's `quantized_matmul`
against our kernel (`engine/quantized_gemv.py`), with the same row against the bf16 weight
beside them. On MLX's CUDA backend only (the kernel is CUDA code).

    python -m bench.quantized_gemv --shapes 4096x6144,4096x4096,4096x28672,14336x4096,4096x128256 \
        --group-size 64 --out FILE.json

Per shape (input width K x output columns N, random weights scaled by 0.02, quantized to 4 bits):
device time a product, as the best over `--repeats` runs of `--calls` products each (queued 10 at
a time, so the device runs them back to back), the bytes of the weight read per second (packed
weight, scales and biases; bf16: the weight), and the host's time to build one call (Python and
MLX's op, not the dispatch). `rel_error`: the largest difference from the float32 product of the
dequantized weight, over the largest magnitude of that product. Bounded: `--calls` x
`--repeats` products per variant and shape.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from trio_mlx.engine.quantized_gemv import available, quantized_gemv


def timed(product: Callable[[Any], Any], x: Any, calls: int, repeats: int) -> tuple[float, float]:
    """(best device seconds a product, best host seconds to build one call)."""
    best = build = float("inf")
    for _ in range(repeats):
        outputs: list[Any] = []
        building = 0.0
        mx.synchronize()
        began = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            outputs.append(product(x))
            building += time.perf_counter() - t
            if len(outputs) % 10 == 0:
                mx.async_eval(outputs[-10:])  # type: ignore[no-untyped-call]
        mx.eval(outputs)
        mx.synchronize()
        best = min(best, (time.perf_counter() - began) / calls)
        build = min(build, building / calls)
    return best, build


def measure(width: int, columns: int, group: int, calls: int, repeats: int) -> dict[str, Any]:
    mx.random.seed(width + columns)
    weight = (mx.random.normal((columns, width)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((1, width)).astype(mx.bfloat16)
    layer = nn.QuantizedLinear(width, columns, bias=False, group_size=group, bits=4)  # type: ignore[attr-defined]
    layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=group, bits=4)
    transposed = weight.T
    mx.eval(weight, x, transposed, layer.parameters())
    exact = (
        x.astype(mx.float32)
        @ mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=group, bits=4)
        .astype(mx.float32)
        .T
    )
    packed = layer.weight.nbytes + layer.scales.nbytes + layer.biases.nbytes
    ours = quantized_gemv(layer)
    assert ours is not None
    row: dict[str, Any] = {"width": width, "columns": columns, "group_size": group}
    variants: dict[str, tuple[Callable[[Any], Any], int]] = {
        "bf16": (lambda a: a @ transposed, weight.nbytes),
        "mlx_q4": (layer, packed),
        "ours_q4": (ours, packed),
    }
    for name, (product, nbytes) in variants.items():
        seconds, build = timed(product, x, calls, repeats)
        error = mx.abs(product(x).astype(mx.float32) - exact).max() / mx.abs(exact).max()
        row[name] = {
            "us": seconds * 1e6,
            "gb_s": nbytes / seconds / 1e9,
            "build_us": build * 1e6,
            "rel_error": None if name == "bf16" else error.item(),
        }
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| K x N | bf16 µs (GB/s) | MLX 4-bit µs (GB/s) | ours µs (GB/s) | ours / MLX | "
        "build µs MLX / ours | rel. error MLX / ours |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b, m, o = r["bf16"], r["mlx_q4"], r["ours_q4"]
        lines.append(
            f"| {r['width']} x {r['columns']} | {b['us']:.1f} ({b['gb_s']:.0f}) | "
            f"{m['us']:.1f} ({m['gb_s']:.0f}) | {o['us']:.1f} ({o['gb_s']:.0f}) | "
            f"{m['us'] / o['us']:.2f}x faster | {m['build_us']:.1f} / {o['build_us']:.1f} | "
            f"{m['rel_error']:.1e} / {o['rel_error']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x6144,4096x4096,4096x28672,14336x4096")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not available():
        raise SystemExit("needs MLX's CUDA backend: the kernel is CUDA code")
    rows = []
    for shape in args.shapes.split(","):
        width, columns = (int(v) for v in shape.split("x"))
        rows.append(measure(width, columns, args.group_size, args.calls, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
