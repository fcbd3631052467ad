"""Decode speed and time to first token: raw mlx-lm `generate_step` against the trio-mlx engine API,
interleaved and repeated in one process, on a synthetic model of a real shape.

The model has random weights (throughput does not depend on their values) and the SmolLM2
tokenizer; EOS is ignored on both sides so every run generates exactly `--tokens` tokens.

    python bench/engine_overhead.py --shape llama-3.2-1b --tokens 256 --prompt 128 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import trio
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama

import trio_mlx
from trio_mlx.engine.loading import LoadedModel, load_model

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
}


def build(out: Path, shape: str, tokenizer_dir: Path, dtype: str, bits: int | None) -> Path:
    config = {
        "model_type": "llama",
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        **SHAPES[shape],
    }
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(getattr(mx, dtype)), model.parameters()))
    if bits:
        import mlx.nn as nn

        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def no_eos_loader(spec: object) -> LoadedModel:
    return dataclasses.replace(load_model(spec), eos_token_ids=frozenset())  # type: ignore[arg-type]


def raw_run(model: object, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
    start = time.perf_counter()
    first = last = 0.0
    tokens = []
    for i, (token, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=n)):
        last = time.perf_counter()
        tokens.append(token)
        if i == 0:
            first = last
    return first - start, (n - 1) / (last - first), tokens


async def engine_run(
    engine: trio_mlx.Engine, prompt: list[int], n: int
) -> tuple[float, float, list[int]]:
    start = time.perf_counter()
    first = last = 0.0
    tokens: list[int] = []
    async for out in engine.stream_generate(prompt, max_tokens=n, temperature=0.0):
        last = time.perf_counter()
        if not tokens:
            first = last
        tokens.extend(out.new_tokens)
    assert len(tokens) == n, len(tokens)
    return first - start, (n - 1) / (last - first), tokens


async def main(args: argparse.Namespace) -> None:
    path = build(
        Path(args.workdir) / args.shape, args.shape, Path(args.tokenizer_dir), args.dtype, args.bits
    )
    prompt = [100 + (i * 37) % 40000 for i in range(args.prompt)]
    rows = []
    interval = None if args.gil_switch_interval <= 0 else args.gil_switch_interval
    async with trio_mlx.open_engine(
        path, loader=no_eos_loader, gil_switch_interval=interval
    ) as engine:
        raw_model = no_eos_loader(path).model
        raw_run(raw_model, prompt, 16)  # warm both
        await engine_run(engine, prompt, 16)
        for r in range(args.repeats):
            raw = raw_run(raw_model, prompt, args.tokens)
            eng = await engine_run(engine, prompt, args.tokens)
            # Same greedy tokens on both sides (a check of the engine on this device too).
            same = sum(a == b for a, b in zip(raw[2], eng[2], strict=True))
            rows.append(
                {
                    "repeat": r,
                    "raw_ttft_ms": raw[0] * 1e3,
                    "raw_tps": raw[1],
                    "engine_ttft_ms": eng[0] * 1e3,
                    "engine_tps": eng[1],
                    "ratio": eng[1] / raw[1],
                    "tokens_equal": f"{same}/{len(raw[2])}",
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    ratios = [r["ratio"] for r in rows]
    print(
        json.dumps(
            {
                "shape": args.shape,
                "dtype": args.dtype,
                "bits": args.bits,
                "device": str(mx.default_device()),
                "tokens": args.tokens,
                "prompt": args.prompt,
                "median_ratio": statistics.median(ratios),
                "median_raw_tps": statistics.median(r["raw_tps"] for r in rows),
                "median_engine_tps": statistics.median(r["engine_tps"] for r in rows),
                "median_raw_ttft_ms": statistics.median(r["raw_ttft_ms"] for r in rows),
                "median_engine_ttft_ms": statistics.median(r["engine_ttft_ms"] for r in rows),
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bits", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gil-switch-interval", type=float, default=0.0005, help="0: leave it")
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--tokenizer-dir", required=True)
    sys.exit(trio.run(main, parser.parse_args()))
