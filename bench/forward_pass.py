"""Where one short forward pass over a long KV cache goes: the whole model against only its
linear layers and only its attention, for a few query lengths (a profiling instrument).

    python -m bench.forward_pass --model synthetic:llama-8b-q4 --offset 2048 --queries 1,8,64,128

For each query length M: the model over M new tokens on a cache holding `--offset` tokens (trimmed
back after each pass); the linear layers of every block (q/k/v/o, gate/up/down) and the output
layer on random inputs of the same shapes; scaled-dot-product attention once per layer (causal).
Milliseconds, median of `--repeats` after 2 warm-ups, synchronised. Llama-shaped models only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
from bench.models import resolve_subject
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load


def timed_ms(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        fn()
        mx.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)


def whole(model: Any, cache: list[Any], tokens: Any) -> None:
    """The model over `tokens` on `cache`, then the cache trimmed back."""
    mx.eval(model(tokens, cache=cache))
    for c in cache:
        c.trim(tokens.shape[1])


def linear(model: Any, x: Any, inner: Any) -> None:
    """Every block's linear layers and the output layer on inputs shaped like one pass's."""
    outs = []
    for layer in model.model.layers:
        a, f = layer.self_attn, layer.mlp
        outs += [a.q_proj(x), a.k_proj(x), a.v_proj(x), a.o_proj(x)]
        outs += [f.gate_proj(x), f.up_proj(x), f.down_proj(inner)]
    head = getattr(model, "lm_head", None) or model.model.embed_tokens.as_linear
    mx.eval([*outs, head(x)])


def attention(q: Any, k: Any, layers: int) -> None:
    """Scaled-dot-product attention once per layer (causal for more than one query)."""
    mask = "causal" if q.shape[2] > 1 else None
    scale = q.shape[-1] ** -0.5
    sdpa = mx.fast.scaled_dot_product_attention
    mx.eval([sdpa(q, k, k, scale=scale, mask=mask) for _ in range(layers)])


def main(args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load(str(resolve_subject(args.model, Path(args.workdir)).path))
    cache = make_prompt_cache(model)
    model(mx.random.randint(0, 1000, (1, args.offset)).astype(mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    config = model.args
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    out: dict[str, Any] = {"model": args.model, "offset": args.offset, "rows": []}
    for m in (int(x) for x in args.queries.split(",")):
        tokens = mx.random.randint(0, 1000, (1, m)).astype(mx.uint32)
        x = mx.random.normal((1, m, config.hidden_size)).astype(mx.bfloat16)
        inner = mx.random.normal((1, m, config.intermediate_size)).astype(mx.bfloat16)
        q = mx.random.normal((1, heads, m, head_dim)).astype(mx.bfloat16)
        k = mx.random.normal((1, kv_heads, args.offset + m, head_dim)).astype(mx.bfloat16)
        row = {
            "M": m,
            "whole_ms": timed_ms(partial(whole, model, cache, tokens), args.repeats),
            "linear_ms": timed_ms(partial(linear, model, x, inner), args.repeats),
            "attention_ms": timed_ms(
                partial(attention, q, k, len(model.model.layers)), args.repeats
            ),
        }
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--offset", type=int, default=2048)
    parser.add_argument("--queries", default="1,8,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--json", default=None)
    main(parser.parse_args())
