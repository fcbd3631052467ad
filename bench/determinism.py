"""Is a greedy reply bitwise the same from run to run? (docs/determinism.md)

    python -m bench.determinism                       # bundled SmolLM2-135M, default settings
    python -m bench.determinism --fixed-chunks 256    # prefill chunks of a fixed size instead
    python -m bench.determinism --busy 2              # with 2 busy-loop processes beside it
    python -m bench.determinism --concurrent 4 --max-num-seqs 8   # 4 at once, batched

A run opens an engine (prefix cache off unless `--prefix-cache`), sends the same greedy request
(a `--prompt-repeat`-sentence prompt, `--max-tokens`, logprobs) `--repeat` times, `--concurrent`
at a time, and prints each reply's fingerprint: a hash of its tokens and their logprobs (the
model's log-softmax, so any change in the logits shows) and how many distinct token lists came
back. One fingerprint for every reply: bitwise
reproducible within the process; run it several times to compare processes (a fresh process
calibrates its prefill rate anew). Every loop is bounded; the busy loops end with the run.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from typing import Any

import trio

import trio_mlx

BUSY_LOOP = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def fingerprint(output: Any) -> str:
    pairs = [(lp.token, lp.logprob) for lp in output.logprobs or []]
    return hashlib.sha1(repr((output.tokens, pairs)).encode()).hexdigest()[:12]


async def run(args: argparse.Namespace) -> tuple[dict[str, int], set[tuple[int, ...]]]:
    config: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if not args.prefix_cache:
        config["cache_memory_bytes"] = 0
    if args.fixed_chunks:
        config |= {"prefill_step_size": args.fixed_chunks, "prefill_chunk_seconds": 1e9}
    prompt = "Tell me a story about a fox and a dog. " * args.prompt_repeat
    seen: dict[str, int] = {}
    token_lists: set[tuple[int, ...]] = set()
    async with trio_mlx.open_engine(args.model, **config) as engine:

        async def one() -> None:
            out = await engine.generate(
                prompt, max_tokens=args.max_tokens, temperature=0.0, logprobs=True
            )
            key = fingerprint(out)
            seen[key] = seen.get(key, 0) + 1
            token_lists.add(tuple(out.tokens))

        for _ in range(args.repeat):
            async with trio.open_nursery() as nursery:
                for _ in range(args.concurrent):
                    nursery.start_soon(one)
    return seen, token_lists


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--prompt-repeat", type=int, default=40, help="sentences in the prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5, help="rounds of requests")
    parser.add_argument("--concurrent", type=int, default=1, help="requests at once a round")
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--fixed-chunks", type=int, default=0, help="prefill chunk tokens")
    parser.add_argument("--prefix-cache", action="store_true", help="keep the prefix cache on")
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside it")
    parser.add_argument("--busy-seconds", type=float, default=300.0, help="their longest life")
    args = parser.parse_args()
    code = BUSY_LOOP.format(seconds=args.busy_seconds)
    busy = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(args.busy)]
    began = time.perf_counter()
    try:
        seen, token_lists = trio.run(run, args)
    finally:
        for process in busy:
            process.terminate()
            process.wait(timeout=10)
    replies = sum(seen.values())
    took = time.perf_counter() - began
    print(f"{replies} replies, {len(seen)} distinct ({len(token_lists)} token lists); {took:.1f} s")
    for key, count in sorted(seen.items(), key=lambda kv: -kv[1]):
        print(f"  {key}  x{count}")


if __name__ == "__main__":
    main()
