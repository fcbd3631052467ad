"""Time to first token with the prefix KV cache against the same requests with the cache cleared,
side by side in one run, on a synthetic model of a real shape (random weights, SmolLM2 tokenizer).

Two scenarios, each measured warm (the cache holds what an earlier request computed) and cold
(right after `clear_runtime_caches()`), alternately, `--repeats` times:
- shared system prompt: a ~`--system-tokens` system prompt; an earlier request from another user
  has gone through it, the measured one asks something else;
- third turn: the third turn of a conversation (same system prompt) after turns one and two.
Greedy tokens of the cached and cold runs are compared (they must be equal). Reports medians and
the ratio cached/cold (the target of issue 4 is at most 0.10).

    python -m bench.prefix_cache --model synthetic:llama-1b-bf16 --system-tokens 2000 --repeats 3
    python -m bench.prefix_cache --model tiny --json /tmp/prefix.json
    python -m bench.prefix_cache --model smollm2      # the real bundled SmolLM2-135M-Instruct
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
from bench.models import resolve_subject

import trio_mlx
from trio_mlx.config import SERVER_PROCESS_SETTINGS
from trio_mlx.engine.loading import LoadedModel, load_model

TOPICS = (
    "the model answers every question with care and cites the relevant policy section "
    "when a customer asks about refunds shipping warranty returns accounts billing "
    "invoices passwords privacy security orders delivery tracking discounts coupons"
)


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
    path = resolve_subject(args.model, Path(args.workdir)).path
    rows: list[dict[str, Any]] = []
    async with trio_mlx.open_engine(
        path,
        **SERVER_PROCESS_SETTINGS,
        loader=no_eos_loader,
        cache_memory_bytes=args.cache_mb * 2**20,
        prefill_block=args.prefill_block,
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
        "model": args.model,
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
        default="synthetic:smollm2-135m-bf16",
        help="tiny, smollm2 (the bundled model, real weights), synthetic:<shape>-<kind> or a "
        "directory (bench/models.py)",
    )
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8, help="per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-mb", type=int, default=2048)
    parser.add_argument(
        "--prefill-block", type=int, default=None, help="the engine's (default: its own choice)"
    )
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--json", default=None, help="also write the rows and summary here")
    trio.run(main, parser.parse_args())
    sys.exit(0)
