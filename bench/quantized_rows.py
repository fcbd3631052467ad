"""A quantized model under load: the bare batched decode step and one long prefill pass, with
MLX's quantized kernels and with the weights dequantized for the product
(`engine/quantized_rows.py`, `dequantize_from_rows`).

    python -m bench.quantized_rows --model synthetic:llama-8b-q4 --out FILE.json   # H200
    python -m bench.quantized_rows --model tiny --quantize 4 --batch 1,4,16 --prefill-tokens 256

Variants, on the same model object (its layers switched in place between them):
- `quantized`: mlx-lm's `QuantizedLinear` as loaded (MLX's `quantized_matmul`);
- `flat`: the same kernel, each input's rows folded into one matrix first ((B, 1, K) becomes
  (B, K)): MLX's CUDA kernel then tiles the rows together instead of taking a batch of B
  one-row matrices (not served: it says how much of the cost is that);
- `dequantized`: every product through the layer's weight dequantized (`route_rows` at one row),
  which `dequantize_from_rows` serves from its threshold on;
- `routed`: what is served on MLX's CUDA backend (`route_rows` at `CUDA_DEQUANTIZE_FROM_ROWS`):
  2 to 8 rows through our kernel that reads the weight once for all of them
  (`quantized_gemv.quantized_rows_product`), other counts below the threshold as `flat`, the
  threshold and above as `dequantized`.

Decode: for each `--batch` B, one `BatchKVCache` per layer holding `--context` positions of
zeros (attention's cost does not depend on the values), then per repeat and variant (alternating)
`--steps` bare steps (the batch's forward pass, an argmax, `mx.eval`), trimmed back to
`--context` after each run. Aggregate tok/s = B / median step time. Prefill: one forward pass of
`--prefill-tokens` random tokens over a fresh cache, the last position's logits and the cache
evaluated, `--prefill-repeats` times per variant after one warm-up; the last logits of each variant
are compared with `quantized`'s. `suggested_threshold`: the smallest measured B from which
`dequantized` is faster than `quantized` at every larger measured B.

Synthetic shapes are built in memory (`bench.compiled_decode.build_synthetic`: random weights,
bf16 quantized to 4 bits, group size 64, no tokenizer); a directory is loaded with its weights as
stored; `--quantize BITS` quantizes a model that has no quantized layers (group size 64; e.g.
the float32 `tiny` on the CPU, where MLX's bfloat16 kernels are slow). No new batch size starts
after `--deadline-s` (the report says which were skipped).
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
import mlx.nn as nn
from bench.compiled_decode import build_synthetic
from bench.models import resolve_subject

from trio_mlx.engine.quantized_rows import CUDA_DEQUANTIZE_FROM_ROWS, route_rows, unroute_rows

VARIANTS = ("quantized", "flat", "dequantized", "routed")


class _FlatRowsLinear(nn.QuantizedLinear):  # type: ignore[misc]
    """`QuantizedLinear` with the input's rows folded into one matrix (the `flat` variant)."""

    def __call__(self, x: Any) -> Any:
        out = super().__call__(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])


class _FlatRowsEmbedding(nn.QuantizedEmbedding):  # type: ignore[misc]
    def as_linear(self, x: Any) -> Any:
        out = super().as_linear(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])


_FLAT = {nn.QuantizedLinear: _FlatRowsLinear, nn.QuantizedEmbedding: _FlatRowsEmbedding}


def set_variant(model: Any, variant: str) -> int:
    """Switch `model`'s quantized layers to `variant` in place; return how many layers it has."""
    unroute_rows(model)
    layers = 0
    for _, module in model.named_modules():
        for plain, flat in _FLAT.items():
            if type(module) in (plain, flat):
                module.__class__ = flat if variant == "flat" else plain
                layers += 1
    if variant == "dequantized":
        route_rows(model, 1)
    elif variant == "routed":
        route_rows(model, CUDA_DEQUANTIZE_FROM_ROWS)
    return layers


def load(spec: str, workdir: Path) -> tuple[Any, str]:
    if spec.startswith("synthetic:"):
        return build_synthetic(spec.split(":", 1)[1]), f"random llama {spec[10:]}, in memory"
    from mlx_lm.utils import load_model

    subject = resolve_subject(spec, workdir)
    return load_model(subject.path)[0], subject.description


def activation_dtype(model: Any) -> Any:
    return model.model.embed_tokens(mx.array([[0]])).dtype


def batch_cache(model: Any, batch: int, context: int) -> list[Any]:
    """Per layer, a `BatchKVCache` of `batch` rows holding `context` positions of zeros."""
    from mlx_lm.models.cache import BatchKVCache

    args = model.args
    heads = args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = activation_dtype(model)
    caches = []
    for _ in model.layers:
        cache = BatchKVCache([0] * batch)
        zeros = mx.zeros((batch, heads, context, head_dim), dtype=dtype)
        cache.update_and_fetch(zeros, zeros)
        caches.append(cache)
    mx.eval([c.keys for c in caches], [c.values for c in caches])
    return caches


def decode_steps(model: Any, caches: list[Any], steps: int) -> list[float]:
    """`steps` bare batched decode steps, each evaluated; the cache is trimmed back after."""
    tokens = mx.zeros((caches[0].left_padding.shape[0],), dtype=mx.uint32)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        logits = model(tokens[:, None], cache=caches)[:, -1, :]
        tokens = mx.argmax(logits, -1).astype(mx.uint32)
        mx.eval(tokens)
        times.append(time.perf_counter() - began)
    for cache in caches:
        cache.trim(steps)
    return times


def prefill_pass(model: Any, tokens: Any) -> tuple[float, Any]:
    """One forward pass of `tokens` over a fresh cache: its time and the last position's logits."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    began = time.perf_counter()
    logits = model(tokens[None], cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return time.perf_counter() - began, logits


def measure_prefill(model: Any, length: int, repeats: int) -> dict[str, Any]:
    vocab = int(model.args.vocab_size)
    tokens = mx.random.randint(0, vocab, (length,), key=mx.random.key(0)).astype(mx.uint32)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    last: dict[str, Any] = {}
    for variant in VARIANTS:  # warm-up: kernels, attention graphs
        set_variant(model, variant)
        _, last[variant] = prefill_pass(model, tokens)
    for _ in range(repeats):
        for variant in VARIANTS:
            set_variant(model, variant)
            times[variant].append(prefill_pass(model, tokens)[0])
            mx.clear_cache()
    reference = last["quantized"].astype(mx.float32)
    scale = mx.abs(reference).max().item() or 1.0
    row: dict[str, Any] = {"tokens": length}
    for variant in VARIANTS:
        row[f"{variant}_ms"] = statistics.median(times[variant]) * 1e3
        row[f"{variant}_tok_s"] = length / statistics.median(times[variant])
    for variant in VARIANTS[1:]:
        got = last[variant].astype(mx.float32)
        row[f"{variant}_max_rel_diff"] = mx.abs(got - reference).max().item() / scale
        row[f"{variant}_same_argmax"] = bool(
            (mx.argmax(got, -1) == mx.argmax(reference, -1)).all().item()
        )
    return row


def measure_decode(
    model: Any, batch: int, context: int, steps: int, repeats: int
) -> dict[str, Any]:
    caches = batch_cache(model, batch, context)
    for variant in VARIANTS:  # warm-up: this shape's kernels, the cache's growth
        set_variant(model, variant)
        decode_steps(model, caches, 2)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for repeat in range(repeats):
        order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            set_variant(model, variant)
            times[variant] += decode_steps(model, caches, steps)
    row: dict[str, Any] = {"batch": batch}
    for variant in VARIANTS:
        step = statistics.median(times[variant])
        row[f"{variant}_step_ms"] = step * 1e3
        row[f"{variant}_tok_s"] = batch / step
    del caches
    mx.clear_cache()
    return row


def suggested_threshold(rows: list[dict[str, Any]]) -> int | None:
    """The smallest measured batch from which `dequantized` beats `quantized` at every larger
    measured batch (None: it never does at the largest)."""
    suggestion = None
    for row in sorted(rows, key=lambda r: -r["batch"]):
        if row["dequantized_step_ms"] >= row["quantized_step_ms"]:
            break
        suggestion = row["batch"]
    return suggestion


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized_rows", description=__doc__)
    parser.add_argument("--model", default="synthetic:llama-8b-q4")
    parser.add_argument("--batch", default="1,2,4,8,16,64,128")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant and batch")
    parser.add_argument("--quantize", type=int, default=None, metavar="BITS")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=150.0)
    parser.add_argument("--workdir", default="/tmp/trio-mlx-compare")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)

    started = time.monotonic()
    model, description = load(args.model, Path(args.workdir))
    layers = set_variant(model, "quantized")
    if not layers and args.quantize:
        nn.quantize(model, group_size=64, bits=args.quantize)
        mx.eval(model.parameters())
        layers = set_variant(model, "quantized")
    if not layers:
        raise SystemExit(f"{args.model} has no quantized layers: nothing to compare")
    loaded_s = time.monotonic() - started
    print(json.dumps({"model": args.model, "quantized_layers": layers, "load_s": loaded_s}))
    prefill = measure_prefill(model, args.prefill_tokens, args.prefill_repeats)
    print(json.dumps({"prefill": prefill}), flush=True)
    rows, skipped = [], []
    for batch in [int(b) for b in args.batch.split(",")]:
        if time.monotonic() - started > args.deadline_s:
            skipped.append(batch)
            continue
        rows.append(measure_decode(model, batch, args.context, args.steps, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    set_variant(model, "quantized")
    report = {
        "model": args.model,
        "description": description,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "platform": platform.platform(),
        "quantized_layers": layers,
        "quantized_here": bool(args.quantize),
        "context": args.context,
        "steps": args.steps,
        "repeats": args.repeats,
        "load_s": loaded_s,
        "elapsed_s": time.monotonic() - started,
        "dequantize_from_rows_default": CUDA_DEQUANTIZE_FROM_ROWS,
        "suggested_threshold": suggested_threshold(rows),
        "prefill": prefill,
        "decode": rows,
        "skipped_batches": skipped,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps({k: report[k] for k in ("suggested_threshold", "elapsed_s", "skipped_batches")})
    )
    return report


if __name__ == "__main__":
    main()
