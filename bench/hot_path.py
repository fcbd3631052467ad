"""Where one request's time goes: time to first token and decode, raw mlx-lm against the engine,
phase by phase, in one process (a profiling instrument, not a benchmark of record).

    python -m bench.hot_path --model synthetic:llama-1b-bf16 --json /tmp/hot.json

The engine runs the serialized route (`max_num_seqs=1`: the `ActiveSequence` this instrument
stamps; the batched route's lone row takes the same forward pass, `BatchDecoder.solo`).

Time to first token, for each prompt length, warm, alternately `--repeats` times:
- `raw`: `mlx_lm.generate_step` from a fresh prompt cache until its first token;
- `engine`: `Engine.stream_generate` (token ids, prefix cache off) until its first token, with the
  engine's phases stamped by wrapping its methods: submit (Trio) -> the runner takes the job
  (`ActiveSequence` built) -> each step (prefill chunks, first token) -> `_deliver` on Trio ->
  the consumer's first output;
- `cached` / `cold`: the same prompt after another prompt sharing all but its last
  `--suffix-tokens` tokens (prefix cache on), against the same with the cache cleared.
Each row is measured twice: as the code is, and with `mx.clear_cache` made a no-op everywhere
(raw included) to show what returning MLX's buffer cache costs.

Prompts of new lengths (`--novel` of them, 200-3,000 tokens): TTFT of raw mlx-lm, of the engine
as configured by default (shape blocks on CUDA) and of the engine with `prefill_block=1`, each
system on a length of its own that no system has seen (on MLX's CUDA backend every new
attention shape costs a cuDNN graph build), order rotated.

Decode: tokens/s of raw `generate_step` and of the engine over `--tokens` tokens, with the CPU
seconds the runner thread and the Trio thread spent per token (from /proc/self/task/*/stat).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from bench.models import resolve_subject
from bench.prefix_cache import system_prompt
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import trio_mlx
from trio_mlx.actors import runner as runner_module
from trio_mlx.actors import snapshot_keeper
from trio_mlx.config import SERVER_PROCESS_SETTINGS
from trio_mlx.engine import decode as decode_module
from trio_mlx.engine.loading import LoadedModel, load_model

# ---- stamps ------------------------------------------------------------------------------------

STAMPS: list[tuple[str, float]] = []  # (what, perf_counter), appended from both threads
_LOCK = threading.Lock()
RUNNER_TID: list[int] = []


def stamp(what: str) -> None:
    with _LOCK:
        STAMPS.append((what, time.perf_counter()))


def wrap(owner: Any, name: str, before: str | None, after: str | None) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before:
            stamp(before)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                stamp(after)

    setattr(owner, name, wrapper)


def instrument() -> None:
    Seq = decode_module.ActiveSequence
    wrap(runner_module.Runner, "submit", "submit", None)
    wrap(runner_module.Runner, "_deliver", "deliver", None)
    wrap(snapshot_keeper.SnapshotKeeper, "restore_for", "restore>", "restore<")
    original_init = Seq.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if not RUNNER_TID:
            RUNNER_TID.append(threading.get_native_id())
        stamp("seq>")
        original_init(self, *args, **kwargs)
        stamp("seq<")

    Seq.__init__ = init  # type: ignore[method-assign]
    original_step = Seq.step

    def step(self: Any, *args: Any) -> Any:
        in_prefill = self.in_prefill
        began = time.perf_counter()
        result = original_step(self, *args)
        ended = time.perf_counter()
        # A prefill chunk yields no token; the step that yields the first one is "first" (it
        # may carry a short prompt tail with it).
        kind = "decode" if not in_prefill else ("first" if result.tokens else "prefill")
        with _LOCK:
            STAMPS.extend(((f"{kind}>", began), (f"{kind}<", ended)))
        return result

    Seq.step = step  # type: ignore[method-assign]


def phases(since: float, consumer_at: float) -> dict[str, float]:
    """Milliseconds per phase of the one request stamped after `since`."""
    with _LOCK:
        marks = [(w, t) for w, t in STAMPS if t >= since]
    out: dict[str, float] = {}

    def first(what: str) -> float | None:
        return next((t for w, t in marks if w == what), None)

    submit, seq_in, seq_out = first("submit"), first("seq>"), first("seq<")
    if submit is None or seq_in is None or seq_out is None:
        return out
    out["call_to_submit"] = (submit - since) * 1e3
    out["submit_to_runner"] = (seq_in - submit) * 1e3
    restore_in, restore_out = first("restore>"), first("restore<")
    if restore_in is not None and restore_out is not None:
        out["restore"] = (restore_out - restore_in) * 1e3
    out["sequence_init"] = (seq_out - seq_in) * 1e3
    prefill = [t for w, t in marks if w in ("prefill>", "prefill<")]
    out["prefill_chunks"] = len(prefill) / 2
    out["prefill"] = sum(b - a for a, b in zip(prefill[::2], prefill[1::2], strict=False)) * 1e3
    first_in, first_out = first("first>"), first("first<")
    if first_in is not None and first_out is not None:
        out["first_token_step"] = (first_out - first_in) * 1e3
        deliver = next((t for w, t in marks if w == "deliver" and t >= first_out), None)
        if deliver is not None:
            out["step_to_deliver"] = (deliver - first_out) * 1e3
            out["deliver_to_consumer"] = (consumer_at - deliver) * 1e3
        gap_from = prefill[-1] if prefill else seq_out
        out["gaps_between_steps"] = (first_in - gap_from) * 1e3
    out["total"] = (consumer_at - since) * 1e3
    return out


# ---- the two sides -----------------------------------------------------------------------------


def no_eos_loader(spec: str | Path | None) -> LoadedModel:
    return dataclasses.replace(load_model(spec), eos_token_ids=frozenset())


def raw_ttft(model: Any, tokens: list[int]) -> float:
    start = time.perf_counter()
    prompt = mx.array(tokens, dtype=mx.uint32)
    for _token, _ in generate_step(
        prompt, model, max_tokens=1, prompt_cache=make_prompt_cache(model)
    ):
        return (time.perf_counter() - start) * 1e3
    raise AssertionError("no token")


async def engine_ttft(
    engine: trio_mlx.Engine, tokens: list[int], max_tokens: int = 1
) -> tuple[float, dict[str, float]]:
    start = time.perf_counter()
    async for out in engine.stream_generate(tokens, max_tokens=max_tokens, temperature=0.0):
        if out.new_tokens:
            at = time.perf_counter()
            return (at - start) * 1e3, phases(start, at)
    raise AssertionError("no token")


async def chat_ttft(
    engine: trio_mlx.Engine, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, dict[str, float]]:
    """Time to the first token of a chat request, with its phases; the stream runs to its end."""
    start = time.perf_counter()
    result = None
    async for out in engine.stream_chat(messages, max_tokens=max_tokens, temperature=0.0):
        if out.new_tokens and result is None:
            at = time.perf_counter()
            result = (at - start) * 1e3, phases(start, at)
    assert result is not None
    return result


async def chat_scenario(engine: trio_mlx.Engine, args: argparse.Namespace) -> dict[str, Any]:
    """bench.prefix_cache's shared-system-prompt case, phase by phase: another user's request
    first, then the measured one (cached), then the same with the cache cleared (cold); and the
    token-prompt equivalent with `max_tokens` 8 to separate chat from generation."""
    system = {"role": "system", "content": system_prompt(engine.tokenizer, args.system_tokens)}
    other = [system, {"role": "user", "content": "How do I reset my password?"}]
    shared = [system, {"role": "user", "content": "Where is my order #1234?"}]
    rows: dict[str, list[Any]] = {"chat_cached": [], "chat_cold": [], "tokens8_cold": []}
    tokens = prompt_tokens(args.system_tokens, 42)
    for _ in range(args.repeats):
        await engine.clear_runtime_caches()
        await chat_ttft(engine, other, 8)
        rows["chat_cached"].append(await chat_ttft(engine, shared, 8))
        await engine.clear_runtime_caches()
        rows["chat_cold"].append(await chat_ttft(engine, shared, 8))
        await engine.clear_runtime_caches()
        rows["tokens8_cold"].append(await engine_ttft(engine, tokens, 8))
    summary: dict[str, Any] = {"system_tokens": args.system_tokens}
    for key, got in rows.items():
        summary[f"{key}_ms"] = statistics.median(t for t, _ in got)
        summary[f"{key}_phases"] = {
            name: round(statistics.median(p.get(name, 0.0) for _, p in got), 3)
            for name in got[0][1]
        }
    print(json.dumps(summary), flush=True)
    return summary


@contextlib.contextmanager
def clear_cache_disabled(disabled: bool) -> Iterator[None]:
    original = mx.clear_cache
    if disabled:
        mx.clear_cache = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        mx.clear_cache = original  # type: ignore[assignment]


def cpu_seconds(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_decode(model: Any, tokens: list[int], n: int) -> float:
    prompt = mx.array(tokens, dtype=mx.uint32)
    start = None
    count = 0
    for count, _ in enumerate(  # noqa: B007 (the count after the loop)
        generate_step(prompt, model, max_tokens=n, prompt_cache=make_prompt_cache(model)), 1
    ):
        if start is None:
            start = time.perf_counter()
    assert start is not None
    return (count - 1) / (time.perf_counter() - start)


async def engine_decode(engine: trio_mlx.Engine, tokens: list[int], n: int) -> dict[str, float]:
    main_tid = threading.get_native_id()
    start = None
    got = 0
    cpu: dict[str, float] = {}
    async for out in engine.stream_generate(tokens, max_tokens=n, temperature=0.0):
        got += len(out.new_tokens)
        if start is None and out.new_tokens:
            start = time.perf_counter()
            cpu = {"runner": cpu_seconds(RUNNER_TID[0]), "trio": cpu_seconds(main_tid)}
    assert start is not None
    elapsed = time.perf_counter() - start
    per = max(got - 1, 1)
    return {
        "tps": (got - 1) / elapsed,
        "runner_cpu_ms_per_token": (cpu_seconds(RUNNER_TID[0]) - cpu["runner"]) / per * 1e3,
        "trio_cpu_ms_per_token": (cpu_seconds(main_tid) - cpu["trio"]) / per * 1e3,
        "wall_ms_per_token": elapsed / per * 1e3,
    }


async def novel_lengths(
    raw_model: Any, engine: trio_mlx.Engine, path: Path, count: int
) -> dict[str, Any]:
    """TTFT on prompts of lengths no system has seen before (see the module docstring)."""
    rng = random.Random(2026)
    names = ("raw", "engine", "engine_block_1")
    rows: dict[str, list[float]] = {name: [] for name in names}
    lengths: dict[str, list[int]] = {name: [] for name in names}
    seen: set[int] = set()
    async with trio_mlx.open_engine(
        path,
        loader=no_eos_loader,
        cache_memory_bytes=0,
        prefill_block=1,
        **{**SERVER_PROCESS_SETTINGS, "max_num_seqs": 1},
    ) as unblocked:
        await engine.clear_runtime_caches()
        for i in range(count):
            base = rng.randrange(200, 3000)
            while seen & {base, base + 1, base + 2}:
                base += 3
            seen.update({base, base + 1, base + 2})
            order = names[i % 3 :] + names[: i % 3]
            for k, name in enumerate(order):
                n = base + k
                tokens = prompt_tokens(n, 1000 + n)
                if name == "raw":
                    ms = raw_ttft(raw_model, tokens)
                else:
                    target = engine if name == "engine" else unblocked
                    await target.clear_runtime_caches()
                    ms, _ = await engine_ttft(target, tokens)
                rows[name].append(ms)
                lengths[name].append(n)
    summary: dict[str, Any] = {"count": count}
    for name in names:
        summary[f"{name}_ms_median"] = statistics.median(rows[name])
        summary[f"{name}_ms"] = [round(t, 2) for t in rows[name]]
        summary[f"{name}_lengths"] = lengths[name]
    print(json.dumps({k: v for k, v in summary.items() if "median" in k}), flush=True)
    return summary


# ---- the run -----------------------------------------------------------------------------------


def prompt_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    subject = resolve_subject(args.model, Path(args.workdir))
    instrument()
    raw_model, _tok = mlx_lm_load(str(subject.path))
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    results: dict[str, Any] = {"model": args.model, "device": str(mx.default_device()), "ttft": []}
    # Warm both sides on every length first (kernels for each shape).
    async with trio_mlx.open_engine(
        subject.path,
        loader=no_eos_loader,
        cache_memory_bytes=args.cache_mb * 2**20,
        **{**SERVER_PROCESS_SETTINGS, "max_num_seqs": 1},
    ) as engine:
        for n in lengths:
            for seed in (1, 2):
                raw_ttft(raw_model, prompt_tokens(n, seed))
                await engine.clear_runtime_caches()
                await engine_ttft(engine, prompt_tokens(n, seed))
        for disabled in (False, True):
            with clear_cache_disabled(disabled):
                for n in lengths:
                    rows: dict[str, list[Any]] = {"raw": [], "engine": [], "cold": [], "cached": []}
                    for repeat in range(args.repeats):
                        tokens = prompt_tokens(n, 100 + repeat)
                        rows["raw"].append(raw_ttft(raw_model, tokens))
                        await engine.clear_runtime_caches()
                        if disabled:
                            pass
                        rows["engine"].append(await engine_ttft(engine, tokens))
                        # prefix: a sibling prompt sharing all but the last suffix tokens
                        sibling = tokens[: -args.suffix_tokens] + prompt_tokens(
                            args.suffix_tokens, 7
                        )
                        await engine.clear_runtime_caches()
                        await engine_ttft(engine, sibling)
                        rows["cached"].append(await engine_ttft(engine, tokens))
                        await engine.clear_runtime_caches()
                        rows["cold"].append(await engine_ttft(engine, tokens))
                    summary: dict[str, Any] = {
                        "prompt_tokens": n,
                        "clear_cache": not disabled,
                        "raw_ms": statistics.median(rows["raw"]),
                    }
                    for key in ("engine", "cold", "cached"):
                        summary[f"{key}_ms"] = statistics.median(t for t, _ in rows[key])
                        summary[f"{key}_phases"] = {
                            name: round(
                                statistics.median(p.get(name, 0.0) for _, p in rows[key]), 3
                            )
                            for name in rows[key][0][1]
                        }
                    summary["cached_over_cold"] = summary["cached_ms"] / summary["cold_ms"]
                    summary["engine_minus_raw_ms"] = summary["engine_ms"] - summary["raw_ms"]
                    results["ttft"].append(summary)
                    print(json.dumps(summary), flush=True)
        results["chat"] = await chat_scenario(engine, args)
        if args.novel:
            results["novel_lengths"] = await novel_lengths(
                raw_model, engine, subject.path, args.novel
            )
        # Decode.
        decode_rows = []
        tokens = prompt_tokens(128, 5)
        await engine.clear_runtime_caches()
        for repeat in range(args.repeats):
            raw = raw_decode(raw_model, tokens, args.tokens)
            eng = await engine_decode(engine, tokens, args.tokens)
            row = {"repeat": repeat, "raw_tps": raw, **{f"engine_{k}": v for k, v in eng.items()}}
            row["engine_over_raw"] = eng["tps"] / raw
            decode_rows.append(row)
            print(json.dumps(row), flush=True)
        results["decode"] = decode_rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-tokens", default="32,2048")
    parser.add_argument("--suffix-tokens", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--novel", type=int, default=12, help="prompts of new lengths (0: none)")
    parser.add_argument("--cache-mb", type=int, default=4096)
    parser.add_argument("--workdir", default="/tmp/trio-mlx-bench")
    parser.add_argument("--json", default=None)
    trio.run(main, parser.parse_args(argv))


if __name__ == "__main__":
    cli()
    sys.exit(0)
