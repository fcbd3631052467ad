"""Time to first token with the prefix KV cache against the same requests with the cache cleared,
side by side in one run, on a synthetic model of a real shape (random weights, SmolLM2 tokenizer).

Two scenarios, each measured warm (the cache holds what an earlier request computed) and cold
(right after `clear_runtime_caches()`), alternately, `--repeats` times:
- shared system prompt: a ~`--system-tokens` system prompt; an earlier request from another user
  has gone through it, the measured one asks something else;
- third turn: the third turn of a conversation (same system prompt) after turns one and two.
Greedy tokens of the cached and cold runs are compared (they must be equal). Reports medians and
the ratio cached/cold (the target of issue 4 is at most 0.10).

    python bench/prefix_cache.py --shape smollm2-135m --system-tokens 2000 --repeats 3
    python bench/prefix_cache.py --shape tiny --json /tmp/prefix.json
    python bench/prefix_cache.py --model default      # the real bundled SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

import trio_mlx
from trio_mlx.engine.default_model import default_gguf_path
from trio_mlx.engine.gguf_tokenizer import write_tokenizer_files
from trio_mlx.engine.loading import LoadedModel, load_model

SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama-3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}

TOPICS = (
    "the model answers every question with care and cites the relevant policy section "
    "when a customer asks about refunds shipping warranty returns accounts billing "
    "invoices passwords privacy security orders delivery tracking discounts coupons"
)


def build_model(out: Path, shape: str, dtype: str) -> Path:
    """A random-weight llama of `shape` with the SmolLM2 tokenizer (from the bundled GGUF)."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
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
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    _weights, metadata = mx.load(str(default_gguf_path()), return_metadata=True)
    write_tokenizer_files(metadata, out, source="SmolLM2 GGUF")
    return out


def no_eos_loader(spec: str | Path | None) -> LoadedModel:
    """EOS ignored, so that every request produces its first token."""
    return dataclasses.replace(load_model(spec), eos_token_ids=frozenset())


def system_prompt(tokenizer: Any, n_tokens: int) -> str:
    rng = random.Random(0)
    vocabulary = TOPICS.split(" ")
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words.extend(rng.choice(vocabulary) for _ in range(50))
    return "You are the support assistant of Example Corp. " + " ".join(words)


async def first_token(
    engine: trio_mlx.Engine, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, trio_mlx.GenerationOutput]:
    """Seconds from the call to the first generated token, and the final output."""
    start = time.perf_counter()
    ttft: float | None = None
    final = None
    async for out in engine.stream_chat(messages, max_tokens=max_tokens, temperature=0.0):
        if ttft is None and out.new_tokens:
            ttft = time.perf_counter() - start
        final = out
    assert ttft is not None and final is not None
    return ttft, final


def turn(messages: list[dict[str, str]], reply: str, question: str) -> list[dict[str, str]]:
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question},
    ]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    path: str | Path | None
    if args.model == "default":
        path = None  # the bundled SmolLM2-135M-Instruct (real weights)
    elif args.model:
        path = args.model
    else:
        path = build_model(
            Path(args.workdir) / f"{args.shape}-{args.dtype}", args.shape, args.dtype
        )
    rows: list[dict[str, Any]] = []
    async with trio_mlx.open_engine(
        path, loader=no_eos_loader, cache_memory_bytes=args.cache_mb * 2**20
    ) as engine:
        system = {"role": "system", "content": system_prompt(engine.tokenizer, args.system_tokens)}
        other = [system, {"role": "user", "content": "How do I reset my password?"}]
        shared = [system, {"role": "user", "content": "Where is my order #1234?"}]
        await first_token(engine, other, 2)  # warm up MLX (kernels, buffers)
        n = args.max_tokens
        for repeat in range(args.repeats):
            await engine.clear_runtime_caches()
            # Shared system prompt: another user's request went first.
            await first_token(engine, other, n)
            warm_shared, out_ws = await first_token(engine, shared, n)
            # A conversation: turns one and two, then the measured third turn.
            one = [system, {"role": "user", "content": "I want to return a jacket."}]
            _, a1 = await first_token(engine, one, n)
            two = turn(one, a1.text, "It is unworn, bought last week.")
            _, a2 = await first_token(engine, two, n)
            three = turn(two, a2.text, "Can I get store credit instead?")
            warm_turn3, out_wt = await first_token(engine, three, n)
            # The same two requests with nothing cached.
            await engine.clear_runtime_caches()
            cold_shared, out_cs = await first_token(engine, shared, n)
            await engine.clear_runtime_caches()
            cold_turn3, out_ct = await first_token(engine, three, n)
            row = {
                "repeat": repeat,
                "shared_prompt_tokens": out_ws.prompt_tokens,
                "shared_cached_tokens": out_ws.cached_tokens,
                "shared_cached_ttft_ms": warm_shared * 1e3,
                "shared_cold_ttft_ms": cold_shared * 1e3,
                "shared_ratio": warm_shared / cold_shared,
                "turn3_prompt_tokens": out_wt.prompt_tokens,
                "turn3_cached_tokens": out_wt.cached_tokens,
                "turn3_cached_ttft_ms": warm_turn3 * 1e3,
                "turn3_cold_ttft_ms": cold_turn3 * 1e3,
                "turn3_ratio": warm_turn3 / cold_turn3,
                "tokens_equal": out_ws.tokens == out_cs.tokens and out_wt.tokens == out_ct.tokens,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        stats = engine.get_cache_stats()

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in rows)

    summary = {
        "model": args.model or f"synthetic {args.shape} {args.dtype}",
        "device": str(mx.default_device()),
        "system_tokens": args.system_tokens,
        "repeats": args.repeats,
        "median_shared_cached_ttft_ms": median("shared_cached_ttft_ms"),
        "median_shared_cold_ttft_ms": median("shared_cold_ttft_ms"),
        "median_shared_ratio": median("shared_ratio"),
        "median_turn3_cached_ttft_ms": median("turn3_cached_ttft_ms"),
        "median_turn3_cold_ttft_ms": median("turn3_cold_ttft_ms"),
        "median_turn3_ratio": median("turn3_ratio"),
        "all_tokens_equal": all(r["tokens_equal"] for r in rows),
        "cache_stats": stats,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "cache_stats"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default=None,
        help="a model spec instead of a synthetic shape ('default': the bundled SmolLM2-135M)",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8, help="per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-mb", type=int, default=2048)
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--json", default=None, help="also write the rows and summary here")
    trio.run(main, parser.parse_args())
    sys.exit(0)
