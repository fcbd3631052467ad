"""How deep the decode loop should queue work, and what a second Python thread costs it.

    python -m bench.decode_pipeline --model synthetic:llama-1b-bf16 --json /tmp/pipe.json

A greedy decode loop as the runner runs it (no logprobs), at three depths:
- depth 0: build a step's graph, evaluate it, read its token (synchronous);
- depth 1: queue step k+1 (`mx.async_eval`) before reading token k (mlx-lm's `generate_step`);
- depth 2: keep two steps queued ahead of the token being read.
Each depth runs alone and with a "consumer" thread that, for every token read, holds the GIL for
`--consumer-ms` of pure Python (what the Trio thread's per-token work does to the runner thread:
detokenizing, the stream actor, SSE). mlx-lm's own `generate_step` runs as the reference.

Per variant: decode tokens/s, and per token the loop's time building graphs (Python), queuing
them (`mx.async_eval`), waiting for tokens (`.item()`) and the loop thread's CPU time. Variants
alternate within each repeat, order rotated; the summary is the median over repeats.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from bench.models import resolve_subject
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load


class Consumer:
    """A thread that holds the GIL for `ms` of pure Python per token handed to it."""

    def __init__(self, ms: float) -> None:
        self._seconds = ms / 1000
        self._inbox: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._inbox.get() is not None:
            end = time.perf_counter() + self._seconds
            x = 0
            while time.perf_counter() < end:
                x += 1

    def push(self, token: int) -> None:
        self._inbox.put(token)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join()


def prefill(model: Any, prompt: Any) -> tuple[list[Any], Any]:
    cache = make_prompt_cache(model)
    first = mx.argmax(model(prompt[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(first)
    return cache, first


def decode(
    model: Any, prompt: Any, n: int, depth: int, consumer: Consumer | None
) -> dict[str, float]:
    """`n` greedy tokens after the prompt, keeping `depth` steps queued ahead of the one read."""
    cache, last = prefill(model, prompt)
    pending: collections.deque[Any] = collections.deque()
    build = launch = wait = 0.0
    built = read = 0
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while read < n:
        while len(pending) <= depth and built < n:
            t = time.perf_counter()
            source = pending[-1] if pending else last
            nxt = mx.argmax(model(source[None], cache=cache)[:, -1, :], axis=-1)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            build += t1 - t
            launch += t2 - t1
            pending.append(nxt)
            built += 1
        t = time.perf_counter()
        last = pending.popleft()
        token = last.item()
        wait += time.perf_counter() - t
        read += 1
        if consumer is not None:
            consumer.push(token)
    seconds = time.perf_counter() - t0
    cpu = time.thread_time() - cpu0
    ms = 1000 / n
    return {
        "tps": n / seconds,
        "build_ms": build * ms,
        "launch_ms": launch * ms,
        "wait_ms": wait * ms,
        "cpu_ms": cpu * ms,
    }


def mlx_lm_decode(model: Any, prompt: Any, n: int, consumer: Consumer | None) -> dict[str, float]:
    """mlx-lm's `generate_step` (which also computes log-probabilities), tokens after the first."""
    steps = generate_step(prompt, model, max_tokens=n + 1)
    next(steps)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for token, _ in steps:
        if consumer is not None:
            consumer.push(int(token))
    seconds = time.perf_counter() - t0
    return {"tps": n / seconds, "cpu_ms": (time.thread_time() - cpu0) * 1000 / n}


def main(args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load(str(resolve_subject(args.model, Path(args.workdir)).path))
    variants = [
        (f"{name}{'+consumer' if busy else ''}", depth, busy)
        for busy in (False, True)
        for name, depth in (("mlx_lm", -1), ("depth0", 0), ("depth1", 1), ("depth2", 2))
    ]
    if args.variants:
        wanted = args.variants.split(",")
        variants = [v for v in variants if v[0] in wanted]
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats + 1):  # repeat 0 warms every variant up
        shift = repeat % len(variants)
        for name, depth, busy in variants[shift:] + variants[:shift]:
            prompt = mx.random.randint(0, 1000, (args.prompt_tokens,), key=mx.random.key(repeat))
            consumer = Consumer(args.consumer_ms) if busy else None
            try:
                if depth < 0:
                    row = mlx_lm_decode(model, prompt.astype(mx.uint32), args.tokens, consumer)
                else:
                    row = decode(model, prompt.astype(mx.uint32), args.tokens, depth, consumer)
            finally:
                if consumer is not None:
                    consumer.close()
            if repeat:
                rows.append({"variant": name, "repeat": repeat, **row})
                print(
                    json.dumps(
                        {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}
                    ),
                    flush=True,
                )
    summary = {}
    for name, _depth, _busy in variants:
        mine = [r for r in rows if r["variant"] == name]
        summary[name] = {
            key: statistics.median(r[key] for r in mine)
            for key in mine[0]
            if key.endswith(("tps", "_ms"))
        }
    out = {
        "model": args.model,
        "environment": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
        "device": str(mx.default_device()),
        "settings": vars(args),
        "summary": summary,
        "rows": rows,
    }
    for name, figures in summary.items():
        print(name, {k: round(v, 3) for k, v in figures.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--variants", default=None, help="comma-separated subset, e.g. mlx_lm,depth1"
    )
    parser.add_argument("--consumer-ms", type=float, default=0.4)
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--json", default=None)
    main(parser.parse_args())
