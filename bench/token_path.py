"""What a streamed token costs the server's host threads: CPU time per delivered token, per thread.

    python -m bench.token_path --model tiny --concurrency 1,16,64 --max-tokens 256 --repeats 3 \
        --out docs/benchmarks/<name>
    python -m bench.token_path --model smollm2 --concurrency 1,8,16 --max-tokens 96 \
        --variant serialized="--max-num-seqs 1" --variant batched-8="--max-num-seqs 8" \
        --variant batched-16="--max-num-seqs 16" --out docs/benchmarks/<name>

Why: under load the server's Python threads share one GIL. The runner thread builds each step's
graph; the Trio thread turns every token into an SSE event (the stream actor's detokenizing and
stop matching, the chunk's JSON, the ASGI send through hypercorn and h11, the socket write).
Whatever the Trio thread spends per token, times the tokens per second, is GIL time the runner
cannot have, so at 64 streams it bounds the aggregate of a fast GPU whatever the model costs.
This measures that cost on any machine (a tiny model makes the model's own cost small).

How: `trio-mlx serve` in a subprocess per `--variant NAME=ARGS` (`--max-num-seqs` the highest
concurrency, admission wait with no refusal before `--burst-timeout-s`, then the variant's own
arguments: `--variant
serialized="--max-num-seqs 1"` against `--variant batched=` compares the two routes; leading
`NAME=VALUE` words are the server's environment instead, so `--variant
before="PYTHONPATH=/tmp/old/src"` against `--variant after=` compares two checkouts), one warm-up
burst each, then for each repeat and concurrency a burst on each variant in turn (the order
rotated from cell to cell, the same prompts for every variant of a cell) of streaming
`/v1/chat/completions` requests (EOS banned through `logit_bias`, so each generates
`--max-tokens`; `--api` picks completions, Responses or Messages instead), read by a plain httpx
SSE reader in this process. The server's threads' CPU
time (`/proc/PID/task/*/stat`, user + system) is read before and after each burst; per thread:
CPU ms, CPU µs per delivered token, and the share of the burst's wall time the thread was on a
CPU. Also: SSE content events per token (below 1 when a slow consumer had its tokens coalesced),
aggregate tok/s, ITL p50/p99. Loopback only; every burst bounded by `--burst-timeout-s`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, keyed by `name/tid`."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def thread_role(key: str, pid: int) -> str:
    """'trio' (the main thread: the event loop), 'runner' (the runner thread and the threads
    started from it, which take its OS name: on the CPU, MLX's and the BLAS's, so there it is
    the model's compute too), or 'other'."""
    name, tid = key.rsplit("/", 1)
    if int(tid) == pid:
        return "trio"
    if name.startswith("trio-mlx-runner"):
        return "runner"
    return "other"


#: The streaming routes a burst can use: its path, and its request body for (model, messages,
#: max_tokens, logit_bias). Only chat and completions take `logit_bias`: on the others a stream
#: can end at EOS before `--max-tokens` (the figures are per delivered token either way).
ROUTES = ("chat", "completions", "responses", "messages")


def request_body(
    api: str, model: str, messages: list[dict[str, str]], max_tokens: int, bias: dict[str, int]
) -> tuple[str, dict[str, Any]]:
    common = {"model": model, "temperature": 0.0, "stream": True}
    if api == "chat":
        body = {"messages": messages, "max_tokens": max_tokens, "logit_bias": bias}
        return "/chat/completions", common | body | {"stream_options": {"include_usage": True}}
    if api == "completions":
        prompt = "\n".join(m["content"] for m in messages)
        body = {"prompt": prompt, "max_tokens": max_tokens, "logit_bias": bias}
        return "/completions", common | body | {"stream_options": {"include_usage": True}}
    if api == "responses":
        return "/responses", common | {"input": messages, "max_output_tokens": max_tokens}
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages if m["role"] != "system"]
    return "/messages", common | {"system": system, "messages": turns, "max_tokens": max_tokens}


def read_event(api: str, event: dict[str, Any]) -> tuple[bool, int | None]:
    """Whether a stream's event carries text, and the completion tokens it reports (if any)."""
    if api in ("chat", "completions"):
        usage = event.get("usage")
        choices = event.get("choices") or []
        text = choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text"))
        return bool(text), usage["completion_tokens"] if usage else None
    kind = event.get("type", "")
    if api == "responses":
        usage = (event.get("response") or {}).get("usage")
        return kind == "response.output_text.delta", usage["output_tokens"] if usage else None
    if kind == "message_delta":
        return False, event["usage"]["output_tokens"]
    return kind == "content_block_delta", None


async def burst(
    base_url: str,
    model: str,
    prompts: list[list[dict[str, str]]],
    max_tokens: int,
    eos: list[int],
    timeout_s: float,
    api: str = "chat",
) -> dict[str, Any]:
    import httpx
    import trio

    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    bias = {str(t): -100 for t in eos}

    async def one(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> None:
        path, body = request_body(api, model, messages, max_tokens, bias)
        start = time.perf_counter()
        times: list[float] = []
        tokens = 0
        async with client.stream("POST", base_url + path, json=body) as response:
            if response.status_code != 200:
                results.append({"status": response.status_code})
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                has_text, reported = read_event(api, json.loads(line[6:]))
                if reported is not None:
                    tokens = reported
                if has_text:
                    times.append(time.perf_counter())
        results.append({"status": 200, "start": start, "times": times, "tokens": tokens})

    start = time.perf_counter()
    with trio.fail_after(timeout_s):
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(one, client, prompt)
    wall = time.perf_counter() - start
    ok = [r for r in results if r["status"] == 200 and r["times"]]
    gaps = sorted(b - a for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False))
    tokens = sum(r["tokens"] for r in ok)
    return {
        "wall_s": wall,
        "ok": len(ok),
        "failed": len(prompts) - len(ok),
        "tokens": tokens,
        "events": sum(len(r["times"]) for r in ok),
        "aggregate_tps": tokens / wall,
        "ttft_ms_p50": 1e3 * statistics.median(r["times"][0] - r["start"] for r in ok)
        if ok
        else None,
        "itl_ms_p50": 1e3 * gaps[len(gaps) // 2] if gaps else None,
        "itl_ms_p99": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
    }


def cpu_figures(before: dict[str, float], after: dict[str, float], pid: int) -> dict[str, float]:
    spent: dict[str, float] = {"trio": 0.0, "runner": 0.0, "other": 0.0}
    for key, cpu in after.items():
        spent[thread_role(key, pid)] += cpu - before.get(key, 0.0)
    return spent


ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def parse_variants(specs: list[str]) -> dict[str, tuple[dict[str, str], list[str]]]:
    """`NAME=ARGS` per variant: its environment (ARGS' leading `KEY=VALUE` words) and its extra
    `trio-mlx serve` arguments (the rest); none given: one, `trio-mlx`."""
    variants: dict[str, tuple[dict[str, str], list[str]]] = {}
    for spec in specs or ["trio-mlx="]:
        name, _, extra = spec.partition("=")
        words = shlex.split(extra)
        env: dict[str, str] = {}
        while words and ENV_WORD.match(words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        variants[name.strip()] = (env, words)
    return variants


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import trio
    from bench.compare import Prompts, Server, free_port, server_env, wait_ready
    from bench.models import resolve_subject

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    subject = resolve_subject(args.model, workdir)
    levels = [int(c) for c in args.concurrency.split(",")]
    variants = parse_variants(args.variant)
    servers: dict[str, Server] = {}
    for name, (_, extra) in variants.items():
        port = free_port()
        argv = [sys.executable, "-m", "trio_mlx", "serve", str(subject.path)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--admission", "wait"]
        argv += ["--max-num-seqs", str(max(levels)), "--max-waiting", str(max(levels))]
        argv += ["--max-wait", str(args.burst_timeout_s), *extra]
        log_path = workdir / f"token_path_{name}.log"
        servers[name] = Server(name, argv, port, log_path, subject.path.name)
    rows: list[dict[str, Any]] = []
    try:
        for name, server in servers.items():  # one at a time: loading shares the cores
            server.start(server_env() | variants[name][0])
            await wait_ready(server, args.server_start_timeout_s)
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        tokenizer = load_tokenizer(subject.path)
        eos = [int(tokenizer.eos_token_id)]
        prompts = Prompts(tokenizer)
        seeds = iter(range(1_000_000))

        def new_batch(n: int) -> list[list[dict[str, str]]]:
            return [prompts.make(args.prompt_tokens, next(seeds))[0] for _ in range(n)]

        model = subject.path.name
        for server in servers.values():
            await burst(
                server.base_url,
                model,
                new_batch(max(levels)),
                16,
                eos,
                args.burst_timeout_s,
                args.api,
            )
        deadline = time.monotonic() + args.deadline_s
        names = list(servers)
        cell = 0
        for repeat in range(args.repeats):
            for level in levels:
                batch = new_batch(level)  # the same prompts for every variant of the cell
                order = names[cell % len(names) :] + names[: cell % len(names)]
                cell += 1
                for name in order:
                    if time.monotonic() > deadline:
                        rows.append(
                            {
                                "variant": name,
                                "concurrency": level,
                                "repeat": repeat,
                                "skipped": "deadline",
                            }
                        )
                        continue
                    server = servers[name]
                    assert server.proc is not None
                    pid = server.proc.pid
                    before = thread_cpu_s(pid)
                    figures = await burst(
                        server.base_url,
                        model,
                        batch,
                        args.max_tokens,
                        eos,
                        args.burst_timeout_s,
                        args.api,
                    )
                    spent = cpu_figures(before, thread_cpu_s(pid), pid)
                    tokens = max(1, figures["tokens"])
                    row = {"variant": name, "concurrency": level, "repeat": repeat, **figures}
                    for role, cpu in spent.items():
                        row[f"{role}_cpu_ms"] = 1e3 * cpu
                        row[f"{role}_us_per_token"] = 1e6 * cpu / tokens
                        row[f"{role}_busy"] = cpu / figures["wall_s"]
                    row["events_per_token"] = figures["events"] / tokens
                    rows.append(row)
                    print(
                        json.dumps(
                            {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                        ),
                        flush=True,
                    )
                    await trio.sleep(0.5)
    finally:
        for server in servers.values():
            server.stop()
    return {
        "command": "python -m bench.token_path " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "rows": rows,
        "model": subject.description,
        "servers": {
            name: [f"{k}={v}" for k, v in variants[name][0].items()] + server.argv[1:]
            for name, server in servers.items()
        },
        "machine": {
            "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    }


def summarize(report: dict[str, Any]) -> str:
    lines = [
        "| variant | streams | aggregate tok/s | TTFT p50 ms | ITL p50 / p99 ms | events/token | "
        "Trio µs/token | Trio busy | runner µs/token | runner busy | other µs/token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    measured = [r for r in report["rows"] if "skipped" not in r]
    levels = sorted({r["concurrency"] for r in measured})
    variants = list(dict.fromkeys(r["variant"] for r in measured))
    for level in levels:
        for variant in variants:
            rows = [r for r in measured if r["concurrency"] == level and r["variant"] == variant]
            if not rows:
                continue

            def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
                return statistics.median(r[key] for r in rows if r[key] is not None)

            lines.append(
                f"| {variant} | {level} | {med('aggregate_tps'):.0f} | {med('ttft_ms_p50'):.0f} | "
                f"{med('itl_ms_p50'):.1f} / {med('itl_ms_p99'):.1f} | "
                f"{med('events_per_token'):.2f} | {med('trio_us_per_token'):.0f} | "
                f"{100 * med('trio_busy'):.0f} % | {med('runner_us_per_token'):.0f} | "
                f"{100 * med('runner_busy'):.0f} % | {med('other_us_per_token'):.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--api",
        choices=ROUTES,
        default="chat",
        help="the streaming route the bursts use (chat: /v1/chat/completions, completions, "
        "responses: /v1/responses, messages: /v1/messages)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=ARGS: a server with these extra trio-mlx serve arguments (repeatable; the "
        "variants' bursts interleave, the same prompts for each)",
    )
    parser.add_argument("--workdir", default="/tmp/trio-mlx-token-path")
    parser.add_argument("--deadline-s", type=float, default=600)
    parser.add_argument("--burst-timeout-s", type=float, default=300)
    parser.add_argument("--server-start-timeout-s", type=float, default=300)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    import trio

    report = trio.run(run, args)
    table = summarize(report)
    print(table)
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        out.with_suffix(".md").write_text(
            f"# Host CPU per streamed token\n\n`{report['command']}`\n\n"
            f"Model: {report['model']}. Machine: {report['machine']}.\n\n"
            + "".join(f"- {n}: `{' '.join(a)}`\n" for n, a in report["servers"].items())
            + "\n"
            "Medians over repeats. µs/token: the thread's CPU time (user + system) during the "
            "burst over the tokens delivered; busy: that CPU time over the burst's wall time.\n\n"
            + table
            + "\n"
        )


if __name__ == "__main__":
    main()
