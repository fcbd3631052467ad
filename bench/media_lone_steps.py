"""One request with an image, alone: its media lane against the decode batch, the runner's calls
alone (no engine, no Trio), in short interleaved blocks of steps.

    python -m bench.media_lone_steps --shape tiny-deep --repeats 6 --out $OUT/steps.json   # CPU
    python -m bench.media_lone_steps --shape qwen2-vl-2b --as-served --out $OUT/steps.json  # GPU

`bench.media_lone` times whole requests through the engine; on a CPU shared with other work its
per-request wall times swing with the load between requests. Here each repeat builds the same
request (one image, greedy, EOS banned) on every route, runs each route's way to its first token
(timed call by call, the routes in turn, the order rotating between repeats), then steps the
routes in turn a block of `--block` decode steps each (the order rotating every block), so that
one route's steps and the next route's are timed within a few hundred milliseconds of each
other; the per-block ratios of median step times against `lane` (median over the blocks, then
over the repeats) are what remains. Before each block the device is synchronized, untimed, and
the block's first step is not counted: a route's step queued ahead (pipelined) is computed
within its own block, not in the next route's.

Routes (as `bench.media_lone`): `lane` (`MultimodalSequence`, the media lane's: its vision step,
its prompt's pass with its first token, one step a token), `join` (a `BatchDecoder` as served:
the vision step, the batch's prefill, its join, its decode steps), `join-batch-path` (the same
with `BatchDecoder.lone_media` off). Each step's wall time and the process's CPU time (every
thread's). Also the operations of one decode step's graph per route (`mx.export_to_dot`: what
the device runs and the host builds each step).

With `--host`, MLX's evaluation calls are timed and `mx.async_eval` evaluates at once: each
step's host time (`step_host_us`: its time outside them, building the graph and choosing) is
then apart from the device's, at the cost of any overlap between them.

Settings, unless `--as-served`: the GPU's, where issue 18's figures were taken (the fused rope
for text positions, pipelined batch steps, a fused prompt tail of 1,024 tokens), so each route
runs the code it runs there; `--as-served`: this device's own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

ROUTES = ("lane", "join", "join-batch-path")

#: seconds spent inside MLX's evaluation calls so far (`--host`: `mx.eval` / `mx.async_eval`
#: timed and synchronous, so that a step's host time is its time outside them)
EVALUATING = [0.0]


def split_host_time() -> None:
    """Make `mx.async_eval` evaluate at once and time both evaluation calls (`EVALUATING`): a
    step's time outside them is what the host spent building and choosing (no overlap with the
    device, which the step then waits for in full)."""
    import mlx.core as mx

    evaluate = mx.eval

    def timed(*arrays: Any) -> None:
        began = time.perf_counter()
        evaluate(*arrays)
        EVALUATING[0] += time.perf_counter() - began

    mx.eval = timed
    mx.async_eval = timed


class Route:
    """One route's sequence of the request: `first()` runs it to its first token (returns its
    calls, timed), `step()` one decode step (returns its wall and CPU seconds)."""

    def __init__(self, name: str, loaded: Any, job: Any, plan: Any, pipelined: bool) -> None:
        from trio_mlx.engine.batch import BatchDecoder
        from trio_mlx.multimodal.job import MultimodalSequence
        from trio_mlx.multimodal.joining import JoiningMediaSequence
        from trio_mlx.multimodal.vision import VisionFeatureCache

        self.name = name
        self.tokens: list[int] = []
        self.finished = False
        vlm = loaded.multimodal
        vocab = len(loaded.tokenizer)
        if name == "lane":
            self._lane: Any = MultimodalSequence(
                job, vlm, VisionFeatureCache(), loaded.eos_token_ids, plan, vocab_size=vocab
            )
            return
        self._batch = BatchDecoder(
            loaded.model, loaded.eos_token_ids, vocab_size=vocab, plan=plan, pipelined=pipelined
        )
        self._batch.lone_media = name == "join"
        seq = self._batch.sequence(job, None, 0, key_tokens=job.keyed().prompt_tokens)
        self._joining = JoiningMediaSequence(seq, vlm, VisionFeatureCache())

    def first(self) -> list[tuple[str, float, float]]:
        """To the first token: (call, wall s, CPU s) of each call."""
        calls: list[tuple[str, float, float]] = []

        def timed(label: str, call: Callable[[], Any]) -> Any:
            began, cpu = time.perf_counter(), time.process_time()
            out = call()
            calls.append((label, time.perf_counter() - began, time.process_time() - cpu))
            return out

        if self.name == "lane":
            timed("vision", self._lane.step)
            while not self.tokens:
                result = timed("lane step", self._lane.step)
                self.tokens.extend(result.tokens)
            return calls
        batch = self._batch
        timed("vision", self._joining.step)
        batch.admit(self._joining.sequence)
        while batch.waiting:
            for pre in timed("batch prefill", lambda: batch.prefill(1 << 20, 1e9)):
                self.tokens.extend(pre.tokens)
            if timed("batch join", batch.join) == 0:
                calls.pop()
        while not self.tokens:
            self._take(timed("batch decode", batch.decode))
        return calls

    def step(self) -> tuple[float, float, float]:
        """One decode step: its wall, CPU and host seconds (host: outside MLX's evaluation
        calls, with `--host`; else its wall time)."""
        began, cpu, evaluating = time.perf_counter(), time.process_time(), EVALUATING[0]
        if self.name == "lane":
            result = self._lane.step()
            self.tokens.extend(result.tokens)
            self.finished = result.finish is not None
        else:
            self._take(self._batch.decode())
        wall = time.perf_counter() - began
        return wall, time.process_time() - cpu, wall - (EVALUATING[0] - evaluating)

    def _take(self, results: list[Any]) -> None:
        for result in results:
            self.tokens.extend(result.tokens)
            self.finished = self.finished or result.finish is not None


def media_job(loaded: Any, seed: int, size: int, max_tokens: int) -> Any:
    """A greedy chat about one image, prepared as the engine prepares it (EOS banned)."""
    from bench.media_lone import picture

    from trio_mlx.multimodal.job import MultimodalJob
    from trio_mlx.multimodal.prepare import VisionInputs, template_owner
    from trio_mlx.types import SamplingParams

    processor = loaded.multimodal.processing.processor
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}
    ]
    prompt = template_owner(processor).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    out = processor(text=[prompt], images=[picture(seed, size)])
    arrays = {k: np.asarray(v) for k, v in dict(out).items()}
    ids = tuple(int(t) for t in arrays.pop("input_ids").reshape(-1))
    arrays.pop("attention_mask", None)
    ban = tuple((t, -100.0) for t in sorted(loaded.eos_token_ids))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=ban)
    vision = VisionInputs(arrays=arrays, media_key=f"image-{seed}", images=1, videos=0)
    return MultimodalJob(seed, ids, params, vision=vision, cache_key=ids)


def step_operations(route: Route) -> Counter[str]:
    """The operations of `route`'s next decode step's graph, by primitive (its step run)."""
    import mlx.core as mx

    seen: list[Counter[str]] = []
    queue = mx.async_eval

    def counting(*arrays: Any) -> None:
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
            mx.export_to_dot(dot.name, *[a for a in arrays if isinstance(a, mx.array)])
            seen.append(Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.read())))
        queue(*arrays)

    mx.async_eval = counting
    try:
        route.step()
    finally:
        mx.async_eval = queue
    return seen[0] if seen else Counter()


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny-deep")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=64, help="decode steps a route a repeat")
    parser.add_argument("--block", type=int, default=8, help="steps a route in turn")
    parser.add_argument("--size", type=int, default=None, help="image side (pixels)")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--as-served", action="store_true")
    parser.add_argument(
        "--host", action="store_true", help="evaluate at once and report each step's host time"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import mlx.core as mx
    from bench.media_lone import build

    from trio_mlx.engine.batch_step import pipelining_pays
    from trio_mlx.engine.decode import PrefillPlan
    from trio_mlx.engine.loading import load_model
    from trio_mlx.multimodal.text_rope import TextRoPE

    if not args.as_served:
        TextRoPE.default = True
        os.environ["TRIO_MLX_BATCH_PIPELINE"] = "on"
    if args.host:
        split_host_time()
    plan = PrefillPlan.choose(2048, tail=None if args.as_served else 1024, block=1, trimmable=True)
    pipelined = pipelining_pays()
    routes = args.routes.split(",")
    size = args.size or (448 if args.shape in ("qwen2-vl-2b", "qwen2.5-vl-3b") else 56)
    repeats: list[dict[str, Any]] = []
    operations: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(build(args.shape, Path(tmp) / "model"))
        warm = media_job(loaded, 999, size, 8)
        for name in routes:  # shapes and kernels once, every route
            warming = Route(name, loaded, warm, plan, pipelined)
            warming.first()
            while not warming.finished:
                warming.step()
        for i in range(args.repeats):
            job = media_job(loaded, i, size, args.steps + 8)
            live = {name: Route(name, loaded, job, plan, pipelined) for name in routes}
            order = routes[i % len(routes) :] + routes[: i % len(routes)]
            firsts = {name: live[name].first() for name in order}
            steps: dict[str, list[list[tuple[float, float, float]]]] = {n: [] for n in routes}
            for k in range(args.steps // args.block):
                for name in order[k % len(order) :] + order[: k % len(order)]:
                    mx.synchronize()
                    block = [live[name].step() for _ in range(args.block)]
                    steps[name].append(block[1:])
            lane = live[routes[0]].tokens[: args.steps]
            same = all(live[n].tokens[: args.steps] == lane for n in routes)
            repeat = summary_of(routes, firsts, steps, same)
            repeats.append(repeat)
            print(json.dumps({"repeat": i, **repeat}), flush=True)
            if i == 0:
                for name in routes:
                    ops = step_operations(live[name])
                    operations[name] = {"total": sum(ops.values()), **dict(ops.most_common())}
        mx.clear_cache()
    report = {
        "command": " ".join(["python -m bench.media_lone_steps", *argv]),
        "shape": args.shape,
        "settings": "as served" if args.as_served else "GPU-like (module docstring)",
        "host_split": args.host,
        "plan": {"step": plan.step, "tail": plan.tail, "pipelined": pipelined},
        "repeats": repeats,
        "summary": overall(repeats, routes),
        "step_operations": operations,
    }
    print(json.dumps({"summary": report["summary"], "step_operations": {
        name: ops["total"] for name, ops in operations.items()}}, indent=1))  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


def summary_of(
    routes: list[str],
    firsts: dict[str, list[tuple[str, float, float]]],
    steps: dict[str, list[list[tuple[float, float, float]]]],
    same: bool,
) -> dict[str, Any]:
    """One repeat: each route's calls to its first token (ms), its step medians (µs) and the
    per-block ratios of its median step against the first route's (medians)."""
    out: dict[str, Any] = {"same_tokens": same}
    base = routes[0]
    for name in routes:
        calls: dict[str, dict[str, float]] = {}
        for label, wall, cpu in firsts[name]:
            entry = calls.setdefault(label, {"calls": 0, "ms": 0.0, "cpu_ms": 0.0})
            entry["calls"] += 1
            entry["ms"] += 1e3 * wall
            entry["cpu_ms"] += 1e3 * cpu
        after_vision = [c for c in firsts[name] if c[0] != "vision"]
        walls = [[w for w, _, _ in block] for block in steps[name]]
        cpus = [[c for _, c, _ in block] for block in steps[name]]
        hosts = [[h for _, _, h in block] for block in steps[name]]
        row: dict[str, Any] = {
            "first_token_calls": calls,
            "vision_to_first_token_ms": 1e3 * sum(w for _, w, _ in after_vision),
            "vision_to_first_token_cpu_ms": 1e3 * sum(c for _, _, c in after_vision),
            "step_us": 1e6 * statistics.median(w for block in walls for w in block),
            "step_cpu_us": 1e6 * statistics.median(c for block in cpus for c in block),
            "step_host_us": 1e6 * statistics.median(h for block in hosts for h in block),
        }
        if name != base:
            mine = steps[base]
            row["step_over_lane"] = block_ratio(walls, [[w for w, _, _ in b] for b in mine])
            row["step_cpu_over_lane"] = block_ratio(cpus, [[c for _, c, _ in b] for b in mine])
            row["step_host_over_lane"] = block_ratio(hosts, [[h for _, _, h in b] for b in mine])
        out[name] = row
    return out


def block_ratio(mine: list[list[float]], base: list[list[float]]) -> float:
    """The median over the blocks of the ratio of median step times."""
    return statistics.median(
        statistics.median(m) / statistics.median(b) for m, b in zip(mine, base, strict=True)
    )


def overall(repeats: list[dict[str, Any]], routes: list[str]) -> dict[str, Any]:
    """Medians over the repeats."""
    keys = (
        "vision_to_first_token_ms",
        "vision_to_first_token_cpu_ms",
        "step_us",
        "step_cpu_us",
        "step_host_us",
        "step_over_lane",
        "step_cpu_over_lane",
        "step_host_over_lane",
    )
    out: dict[str, Any] = {"same_tokens": all(r["same_tokens"] for r in repeats)}
    for name in routes:
        out[name] = {
            key: round(statistics.median(r[name][key] for r in repeats), 3)
            for key in keys
            if key in repeats[0][name]
        }
    base = routes[0]
    for name in routes[1:]:
        out[name]["first_token_over_lane"] = round(
            statistics.median(
                r[name]["vision_to_first_token_ms"] / r[base]["vision_to_first_token_ms"]
                for r in repeats
            ),
            3,
        )
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
