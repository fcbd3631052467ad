"""Measure an OpenAI-compatible server from the client's side: streaming completions over SSE.

For each request: time to first token (first chunk with non-empty text), inter-token latencies,
decode tokens/s and end-to-end latency. Several concurrent streams give the aggregate throughput
and show each server's queueing or refusals (429s). Loopback only; every loop is bounded.

Used by `bench/servers.py`; runnable alone against any server:

    python bench/stream_client.py --base-url http://127.0.0.1:8000/v1 --model M --concurrency 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
import trio


@dataclass
class StreamResult:
    status: int
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunks: int = 0
    completion_tokens: int | None = None
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def decode_tps(self) -> float | None:
        n = self.completion_tokens or self.chunks
        if self.ttft_s is None or n < 2:
            return None
        return (n - 1) / (self.e2e_s - self.ttft_s)


async def stream_once(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str, max_tokens: int
) -> StreamResult:
    """One streaming `/v1/completions` request; text per chunk, usage from the last chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    last = start
    result = StreamResult(status=0)
    with trio.fail_after(600):
        async with client.stream("POST", url, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:200]
                result.e2e_s = time.perf_counter() - start
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    result.completion_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.gaps_s.append(now - last)
                last = now
                result.chunks += 1
    result.e2e_s = time.perf_counter() - start
    return result


async def run_level(
    base_url: str, model: str, prompt: list[int] | str, max_tokens: int, concurrency: int
) -> dict[str, object]:
    """`concurrency` streams at once; returns per-level figures."""
    results: list[StreamResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def one() -> None:
            results.append(
                await stream_once(client, f"{base_url}/completions", model, prompt, max_tokens)
            )

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(one)
        wall = time.perf_counter() - start
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    gaps = sorted(g for r in ok for g in r.gaps_s)
    tokens = sum((r.completion_tokens or r.chunks) for r in ok)

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {
        "concurrency": concurrency,
        "ok": len(ok),
        "refused": sum(1 for r in results if r.status == 429),
        "errors": sorted({f"{r.status}: {r.error}" for r in results if r.status not in (200, 429)}),
        "ttft_ms_p50": 1e3 * statistics.median(r.ttft_s for r in ok if r.ttft_s) if ok else None,
        "decode_tps_p50": statistics.median(r.decode_tps for r in ok if r.decode_tps)
        if ok
        else None,
        "itl_ms_p50": 1e3 * (pct(gaps, 0.5) or 0.0),
        "itl_ms_p99": 1e3 * (pct(gaps, 0.99) or 0.0),
        "e2e_s_p50": statistics.median(r.e2e_s for r in ok) if ok else None,
        "aggregate_tps": tokens / wall if wall > 0 else None,
        "sample": asdict(ok[0]) | {"gaps_s": None} if ok else None,
    }


async def main(args: argparse.Namespace) -> None:
    prompt = " ".join(["hello"] * args.prompt)
    for level in args.concurrency:
        print(json.dumps(await run_level(args.base_url, args.model, prompt, args.tokens, level)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    trio.run(main, parser.parse_args())
