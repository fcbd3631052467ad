"""A burst of requests arriving at once: time to first token through the engine API and through
`trio-mlx serve`, and with the arrivals prefilled together in one pass (`engine/batch_prefill.py`)
against one pass each.

    python -m bench.burst --models synthetic:llama-1b-bf16,synthetic:llama-8b-bf16 \\
        --streams 16,64 --json $OUT/burst.json                                  # on the H200
    python -m bench.burst --models tiny --streams 8 --repeats 1                 # CPU smoke
    python -m bench.burst --models tiny --streams 16 --via engine,http --grouped off \\
        --repeats 12 --max-tokens 32       # the HTTP path against the engine API, in one run
    python -m bench.burst --models tiny --streams 16 --via engine,http --grouped off \\
        --http-src before=/path/to/other/checkout/src --http-src after=src   # two servers

Cells (`--via`, `--grouped`, `--http-src`), alternating cell by cell, the order rotated from
repeat to repeat:
- `engine grouped` / `engine one_each`: the engine API in this process (`trio-mlx serve`'s
  settings: `max_num_seqs` 64, admission wait, the prefix cache on, the prefill step size it
  picks, 256 tokens on MLX's CPU backend), the weights loaded once, `BatchDecoder.group_prefill`
  on / off; a new engine per cell;
- `http` (or `http:NAME` per `--http-src NAME=DIR`: a server run with DIR first on its
  PYTHONPATH, e.g. the source tree of another commit): `trio-mlx serve` in a subprocess
  (`--max-num-seqs 64 --admission wait --max-waiting 256`, group prefill as it serves by
  default, one server per source for the whole run), driven over loopback through
  `/v1/chat/completions` with streaming, one connection per stream, by the `openai`
  AsyncOpenAI client (`--client openai`, max_retries=0, as `bench.compare` drives every server),
  a plain httpx SSE reader (`--client httpx`), or `--client raw`: the requests encoded and their
  connections opened beforehand, written back to back when the clock starts, each response read
  as bytes (a client whose own cost is next to nothing: on a 2-core host the openai client's
  own work spreads the 16 requests' arrival over tens of ms and competes with the server).

Per cell: a warm-up burst like the timed one (4 tokens each: its shapes, the template prefix in
the cache), then `N` greedy chats of distinct ~`--prompt-words`-word prompts (never seen before by
that engine or server: no prefix-cache hits beyond the template's system prompt) start together,
`--max-tokens` tokens each, EOS banned. Reported: time to first token (the first text) p50 /
p90 / max over the N, from the burst's start; the aggregate decode rate (completion tokens over
the wall time from the burst's start to the last end); for the engine cells the prefill passes
the burst took; per model, each cell's TTFT p50 over the engine cell's of the same repeat
(`ratios`, median over repeats). Random weights: speed only.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio
from bench.models import resolve_subject

from trio_mlx.engine.loading import LoadedModel, load_model

WORDS = ["the", "lighthouse", "keeper", "watched", "the", "grey", "sea", "roll", "under", "a"]
COUNTERS = ("prefill_chunks", "prefill_groups", "grouped_prefills", "prefill_group_failures")


def prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
    return f"Request {i}: {body}. Tell me more."


def ttft_figures(firsts: list[float], tokens: list[int], wall: float) -> dict[str, Any]:
    ordered = sorted(firsts)
    return {
        "ttft_p50_ms": 1e3 * statistics.median(ordered),
        "ttft_p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "ttft_max_ms": 1e3 * ordered[-1],
        "aggregate_tok_s": sum(tokens) / wall,
    }


async def engine_burst(
    loaded: LoadedModel, grouped: bool, streams: int, first_id: int, args: Any
) -> dict[str, Any]:
    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS
    from trio_mlx.engine.batch import BatchDecoder

    BatchDecoder.group_prefill = grouped
    from trio_mlx.cli_options import CPU_PREFILL_STEP_SIZE, PREFILL_STEP_SIZE
    from trio_mlx.engine.cpu_path import on_cpu_backend

    options: dict[str, Any] = {
        **SERVER_PROCESS_SETTINGS,
        "max_num_seqs": 64,
        "admission": "wait",
        "max_waiting": 256,
        # as `trio-mlx serve` chooses it (on MLX's CPU backend, 256 tokens a prefill pass)
        "prefill_step_size": CPU_PREFILL_STEP_SIZE if on_cpu_backend() else PREFILL_STEP_SIZE,
    }
    ban = {int(t): -100.0 for t in loaded.eos_token_ids}
    async with trio_mlx.open_engine("model", loader=lambda _spec: loaded, **options) as engine:
        # warm-up: a burst like the timed one (its shapes, the template prefix in the cache, the
        # logit bias: its first use compiles kernels on MLX's CUDA backend)
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                messages = [{"role": "user", "content": prompt(first_id + i, args.prompt_words)}]
                nursery.start_soon(
                    partial(engine.chat, messages, max_tokens=4, temperature=0, logit_bias=ban)
                )
        before = {k: engine.get_stats()["runner"][k] for k in COUNTERS}
        firsts: list[float] = []
        done: list[int] = []
        began = time.perf_counter()

        async def one(i: int) -> None:
            messages = [{"role": "user", "content": prompt(i, args.prompt_words)}]
            first = None
            last: Any = None
            async for out in engine.stream_chat(
                messages, max_tokens=args.max_tokens, temperature=0, logit_bias=ban
            ):
                if first is None and out.new_text:
                    first = time.perf_counter() - began
                last = out
            assert first is not None and last is not None
            firsts.append(first)
            done.append(last.completion_tokens)

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, first_id + streams + i)
        wall = time.perf_counter() - began
        return {
            **ttft_figures(firsts, done, wall),
            **{k: engine.get_stats()["runner"][k] - before[k] for k in COUNTERS},
        }


class HTTPTarget:
    """`trio-mlx serve` in a subprocess, and the client that drives it. `src`: a trio-mlx source
    tree put first on the server's PYTHONPATH (None: the one this runs)."""

    def __init__(self, path: Path, args: Any, name: str = "http", src: str | None = None) -> None:
        from bench.compare import Server, free_port

        port = free_port()
        argv = [sys.executable, "-m", "trio_mlx", "serve", str(path)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "64"]
        argv += ["--admission", "wait", "--max-waiting", "256", "--max-wait", "600"]
        argv += args.serve_args.split()
        args.workdir.mkdir(parents=True, exist_ok=True)
        log = args.workdir / f"burst_serve_{name}.log"
        self.server = Server("http", argv, port, log, path.name)
        self.args = args
        self.src = src
        self.eos: list[int] = []

    async def start(self, eos: list[int]) -> None:
        from bench.compare import served_name, server_env, wait_ready

        self.eos = eos
        env = server_env()
        if self.src is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.src, env.get("PYTHONPATH")]))
        self.server.start(env)
        await wait_ready(self.server, 600)
        self.name = await served_name(self.server)

    def stop(self) -> None:
        self.server.stop()

    def _body(self, i: int, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.name,
            "messages": [{"role": "user", "content": prompt(i, self.args.prompt_words)}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {str(t): -100 for t in self.eos},
        }

    async def _one(self, client: Any, i: int, max_tokens: int) -> tuple[float | None, int]:
        """One streamed chat; (when its first content arrived, completion tokens)."""
        body = self._body(i, max_tokens)
        first: float | None = None
        tokens = 0
        if self.args.client == "openai":
            stream = await client.chat.completions.create(**body)
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
            return first, tokens
        async with client.stream("POST", "/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                choices = event.get("choices") or []
                if first is None and choices and choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter()
        return first, tokens

    async def burst(self, streams: int, first_id: int) -> dict[str, Any]:
        if self.args.client == "raw":
            return await self._raw_burst(streams, first_id)
        import httpx

        limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
        http = httpx.AsyncClient(base_url=self.server.base_url, timeout=600, limits=limits)
        client: Any = http
        if self.args.client == "openai":
            import openai

            client = openai.AsyncOpenAI(
                base_url=self.server.base_url, api_key="bench", max_retries=0, http_client=http
            )
        async with http:
            async with trio.open_nursery() as nursery:  # warm-up (the connections too)
                for i in range(streams):
                    nursery.start_soon(self._one, client, first_id + i, 4)
            firsts: list[float] = []
            done: list[int] = []
            began = time.perf_counter()

            async def one(i: int) -> None:
                first, tokens = await self._one(client, i, self.args.max_tokens)
                assert first is not None
                firsts.append(first - began)
                done.append(tokens)

            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, first_id + streams + i)
            wall = time.perf_counter() - began
        return {**ttft_figures(firsts, done, wall), "burst_began": began}

    async def _raw_burst(self, streams: int, first_id: int) -> dict[str, Any]:
        """`--client raw`: the requests encoded and their connections opened beforehand, then
        written back to back when the clock starts; each response read as bytes, its first
        content event found by a byte search (a client whose own cost is next to nothing)."""
        firsts: list[float] = []
        done: list[int] = []

        def request(i: int, max_tokens: int) -> bytes:
            body = json.dumps(self._body(i, max_tokens)).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.server.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            return head.encode() + body

        async def read(stream: trio.SocketStream, began: float) -> None:
            data = b""
            first = None
            while not data.endswith(b"0\r\n\r\n"):
                chunk = await stream.receive_some(1 << 16)
                if not chunk:
                    break
                data += chunk
                if first is None and b'"content":"' in data:
                    first = time.perf_counter() - began
            assert first is not None, data[:300]
            usage = data.rsplit(b'"completion_tokens":', 1)[1]
            firsts.append(first)
            done.append(int(usage.split(b",")[0].split(b"}")[0]))

        async def burst(ids: range, max_tokens: int) -> tuple[float, float]:
            conns = [await trio.open_tcp_stream("127.0.0.1", self.server.port) for _ in ids]
            payloads = [request(i, max_tokens) for i in ids]
            began = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for conn, payload in zip(conns, payloads, strict=True):
                    await conn.send_all(payload)
                for conn in conns:
                    nursery.start_soon(read, conn, began)
            wall = time.perf_counter() - began
            for conn in conns:
                await conn.aclose()
            return began, wall

        await burst(range(first_id, first_id + streams), 4)  # warm-up
        firsts.clear()
        done.clear()
        ids = range(first_id + streams, first_id + 2 * streams)
        began, wall = await burst(ids, self.args.max_tokens)
        return {**ttft_figures(firsts, done, wall), "burst_began": began}


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="synthetic:llama-1b-bf16,synthetic:llama-8b-bf16")
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--via", default="engine", help="engine, http or engine,http")
    parser.add_argument("--grouped", default="on,off", help="engine cells: group prefill on/off")
    parser.add_argument("--client", choices=("openai", "httpx", "raw"), default="openai")
    parser.add_argument("--serve-args", default="", help="extra `trio-mlx serve` arguments")
    parser.add_argument(
        "--http-src",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="with --via http: a server from the trio-mlx source tree DIR (e.g. a worktree of "
        "another commit), cells `http:NAME`, alternated with the others (repeatable; none: "
        "one server from this tree, cells `http`)",
    )
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"command": " ".join(["python -m bench.burst", *argv])}
    vias = args.via.split(",")
    groupings = {"on": True, "off": False}
    sources: dict[str, str | None] = {"http": None}
    if args.http_src:
        sources = {f"http:{n}": d for n, _, d in (spec.partition("=") for spec in args.http_src)}
    kinds = [f"engine {'grouped' if groupings[g] else 'one_each'}" for g in args.grouped.split(",")]
    kinds = kinds if "engine" in vias else []
    kinds += list(sources) if "http" in vias else []
    ids = itertools.count(0, 1000)  # every cell its own prompts
    for spec in args.models.split(","):
        path = resolve_subject(spec, args.workdir).path
        loaded = load_model(path) if "engine" in vias else None
        targets: dict[str, HTTPTarget] = {}
        if "http" in vias:
            for name, src in sources.items():
                targets[name] = HTTPTarget(path, args, name.replace(":", "_"), src)
        cells: dict[str, list[dict[str, Any]]] = {}
        try:
            if targets:
                eos = sorted(int(t) for t in (loaded or load_model(path)).eos_token_ids)
                for target in targets.values():  # one at a time: loading shares the cores
                    trio.run(target.start, eos)
            for repeat in range(args.repeats):
                for streams in (int(n) for n in args.streams.split(",")):
                    shift = repeat % len(kinds)
                    for kind in kinds[shift:] + kinds[:shift]:
                        if kind in targets:
                            cell = trio.run(targets[kind].burst, streams, next(ids))
                        else:
                            assert loaded is not None
                            grouped = kind.endswith("grouped")
                            cell = trio.run(engine_burst, loaded, grouped, streams, next(ids), args)
                        key = f"{streams} {kind}"
                        cells.setdefault(key, []).append(cell)
                        shown = {k: v for k, v in cell.items() if k != "burst_began"}
                        print(json.dumps({"model": spec, "cell": key, **shown}), flush=True)
        finally:
            for target in targets.values():
                target.stop()
        summary = {
            key: {
                m: statistics.median(c[m] for c in runs)
                for m in runs[0]
                if m != "burst_began" and all(m in c for c in runs)
            }
            for key, runs in cells.items()
        }
        report[spec] = {"cells": cells, "median": summary, "ratios": _ratios(cells)}
        print(json.dumps({spec: summary, "ratios": report[spec]["ratios"]}, indent=1), flush=True)
        with contextlib.suppress(NameError):
            del loaded
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


def _ratios(cells: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """TTFT p50 of each cell against the first engine cell of the same repeat and stream count
    (the two ran back to back), median over the repeats."""
    out: dict[str, float] = {}
    for key, runs in cells.items():
        streams = key.split()[0]
        engine = next((k for k in cells if k.startswith(f"{streams} engine")), None)
        if engine is None or engine == key:
            continue
        pairs = zip(runs, cells[engine], strict=False)
        ratios = [c["ttft_p50_ms"] / e["ttft_p50_ms"] for c, e in pairs]
        out[f"{key} / {engine}"] = statistics.median(ratios)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
