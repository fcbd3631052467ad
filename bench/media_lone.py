"""One request with an image, alone: its own lane against the decode batch, phase by phase.

    python -m bench.media_lone --shape tiny-deep --pairs 6 --out $OUT/media-lone.json   # CPU
    python -m bench.media_lone --shape qwen2-vl-2b --pairs 6 --as-served --out $OUT/ml.json  # GPU

Each pair runs the same greedy chat (one image, `--max-tokens` tokens, EOS banned) on every
route back to back through the engine API, the order reversed from pair to pair, the weights
loaded once, one engine a request (`max_num_seqs` 4), after a warm-up request of the same shape
on that engine, the vision and prefix caches cleared before the timed one:
- `lane`: the request decodes beside the batch in the media lane (`media_lane.can_join` False),
  the serialized route's sequence (`MultimodalSequence`);
- `join`: it joins the batch after its vision step (`multimodal.joining`), as served;
- `join-batch-path`: as `join`, with `BatchDecoder.lone_media` off: its first token from the
  batch's first decode step, every step through the batch's shifted forward pass (what it was
  before the lone media row took the lane's path).

On the CPU, unless `--as-served`, the engine is set up as on a GPU where the figures of issue 18
were taken: text positions through the fused rope (`TextRoPE.default`), the batch's steps
pipelined (`TRIO_MLX_BATCH_PIPELINE=on`), a prompt's rest of up to 1,024 tokens fused into its
first token's pass (`fused_tail_tokens`), so that each route runs the code it runs there.

Timed on the runner thread (the wrapped calls, perf_counter, and the process's CPU time, every
thread's: MLX's CPU backend computes on threads of its own): the vision step; the lane's steps
(its first, which prefills and gives the first token, and each decode step); the batch's
`prefill`, `join` and `decode` calls; the runner loop's whole iteration while the request
decodes (`RunnerCounters.note_step`). Per request: the time from the call to the vision step,
the vision step, from its end to the end of the call that produced the first token (and the
calls in between: `first_token_calls`), from there to the consumer; each decode step's wall
and CPU time (`step_us`, `step_cpu_us`: a lane step or a batch `decode`, medians) and the loop
iteration's (`loop_us`). On the consumer's side: time to first token from the call, the decode
rate after it ((tokens - 1) over the time from the first token to the last) and the process's
CPU time a token over the same span (`decode_cpu_us_per_token`: on a CPU shared with other
work, wall times swing with the load, CPU times much less). Reported per route: medians over
the pairs, and the within-pair ratios against `lane` (`RATIOS`). Whole requests a pair apart
drift with a shared machine's load; `bench.media_lone_steps` times the runner's calls alone, the
routes interleaved in blocks of a few steps.

Shapes (random weights, SmolLM2's vocabulary plus the vision tokens: see bench.multimodal):
`tiny` (tests/tiny_vlm.py: 2 layers of width 64), `tiny-deep` (28 such layers: the layer count of
Qwen2-VL-2B, so a step dispatches as many operations as the 2B's while computing little: a
host-bound step, as the H200's is), `small` (8 layers, width 512) and the real shapes of
bench.multimodal (`qwen2-vl-2b`: 448x448 images; 56x56 on the others).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

#: extra shapes for this CPU (bench.multimodal's SHAPES take the rest)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny-deep": {"model_type": "qwen2_vl", "text": {"num_hidden_layers": 28}},
    "small": {
        "model_type": "qwen2_vl",
        "text": {
            "hidden_size": 512,
            "num_hidden_layers": 8,
            "intermediate_size": 1536,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        },
        "vision": {"hidden_size": 512},  # the merger's output: the text model's width
    },
}

ROUTES = ("lane", "join", "join-batch-path")

#: (phase, began, ended, tokens, CPU seconds) of the wrapped calls, on the runner thread (the
#: CPU time is the process's, every thread's: MLX's CPU backend computes on threads of its own)
TRACE: list[tuple[str, float, float, int, float]] = []


def build(shape: str, out: Path) -> Path:
    import mlx.core as mx
    from bench.multimodal import SHAPES as REAL
    from bench.multimodal import build as build_real

    from tiny_vlm import build_tiny_vlm

    if shape in REAL:
        return build_real(shape, out)
    spec = SHAPES[shape]
    return build_tiny_vlm(
        out,
        model_type=spec["model_type"],
        text=spec.get("text"),
        vision=spec.get("vision"),
        max_pixels=spec.get("max_pixels", 784 * 64),
        dtype=mx.bfloat16 if spec.get("bf16") else None,
    )


def picture(seed: int, size: int) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def traced(owner: Any, name: str, phase: Callable[[Any, Any], str | None]) -> None:
    """Wrap `owner.name` so that each call is recorded in TRACE under `phase(self, result)`."""
    inner = getattr(owner, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        began, cpu = time.perf_counter(), time.process_time()
        result = inner(self, *args, **kwargs)
        ended, cpu = time.perf_counter(), time.process_time() - cpu
        label = phase(self, result)
        if label is not None:
            TRACE.append((label, began, ended, _tokens(result), cpu))
        return result

    setattr(owner, name, wrapper)


def _tokens(result: Any) -> int:
    if isinstance(result, list):
        return sum(len(getattr(r, "tokens", ())) for r in result)
    return len(getattr(result, "tokens", ()))


def install_tracing() -> None:
    from trio_mlx.actors.runner_protocol import RunnerCounters
    from trio_mlx.engine.batch import BatchDecoder
    from trio_mlx.multimodal.job import MultimodalSequence
    from trio_mlx.multimodal.joining import JoiningMediaSequence

    traced(JoiningMediaSequence, "step", lambda s, r: "vision")
    inner_step = MultimodalSequence.step

    def lane_step(self: Any, prefill_limit: int | None = None) -> Any:
        began, cpu = time.perf_counter(), time.process_time()
        vision = self._inner is None
        result = inner_step(self, prefill_limit)
        ended, cpu = time.perf_counter(), time.process_time() - cpu
        if vision:
            label = "vision"
        elif result.prefilled:
            label = "lane_first" if result.tokens else "lane_prefill"
        else:
            label = "lane_decode"
        TRACE.append((label, began, ended, len(result.tokens), cpu))
        return result

    MultimodalSequence.step = lane_step  # type: ignore[method-assign]
    traced(BatchDecoder, "prefill", lambda s, r: "batch_prefill")
    traced(BatchDecoder, "join", lambda s, r: "batch_join" if r else None)
    traced(BatchDecoder, "decode", lambda s, r: "batch_decode")
    inner_note = RunnerCounters.note_step

    def note_step(self: Any, step: Any) -> None:
        TRACE.append(("loop", time.perf_counter() - step.seconds, time.perf_counter(), 0, 0.0))
        inner_note(self, step)

    RunnerCounters.note_step = note_step  # type: ignore[method-assign]


async def one_request(engine: Any, image: Any, max_tokens: int) -> dict[str, Any]:
    """One timed chat; its consumer-side figures and the runner's phases."""
    ban = {t: -100.0 for t in engine.info.eos_token_ids}
    stamps: list[tuple[float, int, float]] = []
    TRACE.clear()
    began = time.perf_counter()
    async for out in engine.stream_chat(
        [{"role": "user", "content": "Describe it."}],
        images=[image],
        max_tokens=max_tokens,
        temperature=0.0,
        logit_bias=ban,
    ):
        if out.new_tokens:
            stamps.append((time.perf_counter(), len(out.new_tokens), time.process_time()))
    trace = list(TRACE)
    first = stamps[0][0]
    tokens = sum(n for _, n, _ in stamps)
    figures: dict[str, Any] = {
        "ttft_ms": 1e3 * (first - began),
        "decode_tok_s": (tokens - stamps[0][1]) / (stamps[-1][0] - first),
        # the process's CPU time (every thread) a token after the first: robust to the load
        # other processes put on a shared machine, where wall time is not
        "decode_cpu_us_per_token": 1e6 * (stamps[-1][2] - stamps[0][2]) / (tokens - stamps[0][1]),
        "tokens": tokens,
    }
    figures.update(phases(trace, began, first))
    return figures


def phases(
    trace: list[tuple[str, float, float, int, float]], began: float, first: float
) -> dict[str, Any]:
    """The runner's phases of one request: time to first token split at the runner's calls
    (ms), then the per-step host times of its decode (µs, medians)."""
    out: dict[str, Any] = {}
    vision = [t for t in trace if t[0] == "vision"]
    if vision:
        out["to_vision_ms"] = 1e3 * (vision[0][1] - began)
        out["vision_ms"] = 1e3 * (vision[0][2] - vision[0][1])
    # the call that produced the first token, and what ran between the vision step and it
    produced = next((t for t in trace if t[0] != "loop" and t[3] > 0), None)
    if produced is not None and vision:
        spent: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for label, t0, t1, _, _ in trace:
            if label in ("loop", "vision") or t0 < vision[0][2] or t0 > produced[1]:
                continue
            spent[label] += 1e3 * (t1 - t0)
            calls[label] += 1
        out["first_token_calls"] = {k: {"ms": spent[k], "calls": calls[k]} for k in spent}
        out["vision_to_first_token_ms"] = 1e3 * (produced[2] - vision[0][2])
        out["first_token_to_consumer_ms"] = 1e3 * (first - produced[2])
    after = [t for t in trace if produced is not None and t[1] > produced[2]]
    for label in ("lane_decode", "batch_decode", "loop"):
        times = [1e6 * (t1 - t0) for name, t0, t1, _, _ in after if name == label]
        if label == "loop":  # the iterations that stepped this request
            times = times[2:-2] if len(times) > 8 else times
        if times:
            out["loop_us" if label == "loop" else "step_us"] = statistics.median(times)
        cpu = [1e6 * c for name, _, _, _, c in after if name == label]
        if cpu and label != "loop":
            out["step_cpu_us"] = statistics.median(cpu)
    return out


async def timed(
    loaded: Any, route: str, image: Any, warm: Any, max_tokens: int, options: dict[str, Any]
) -> dict[str, Any]:
    import trio_mlx
    from trio_mlx.actors import media_lane
    from trio_mlx.engine.batch import BatchDecoder

    joins = media_lane.can_join
    lone_media = getattr(BatchDecoder, "lone_media", None)
    try:
        if route == "lane":
            media_lane.can_join = lambda *a: False
        if route == "join-batch-path" and lone_media is not None:
            BatchDecoder.lone_media = False
        async with trio_mlx.open_engine(
            "model", loader=lambda _spec: loaded, max_num_seqs=4, **options
        ) as engine:
            await one_request(engine, warm, 8)
            await engine.clear_runtime_caches()
            engine._runner.vision_cache.clear()
            result = await one_request(engine, image, max_tokens)
            result["runner"] = {
                k: engine.get_stats()["runner"].get(k) for k in ("media_joined", "media_steps")
            }
            return result
    finally:
        media_lane.can_join = joins
        if lone_media is not None:
            BatchDecoder.lone_media = lone_media


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny-deep")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--size", type=int, default=None, help="image side (pixels)")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument(
        "--as-served", action="store_true", help="this device's own defaults (module docstring)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import trio

    from trio_mlx.config import SERVER_PROCESS_SETTINGS
    from trio_mlx.engine.loading import load_model
    from trio_mlx.multimodal.text_rope import TextRoPE

    options: dict[str, Any] = {**SERVER_PROCESS_SETTINGS}
    if not args.as_served:
        TextRoPE.default = True
        os.environ["TRIO_MLX_BATCH_PIPELINE"] = "on"
        options["fused_tail_tokens"] = 1024
    install_tracing()
    routes = args.routes.split(",")
    size = args.size or (448 if args.shape in ("qwen2-vl-2b", "qwen2.5-vl-3b") else 56)
    pairs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(build(args.shape, Path(tmp) / "model"))
        for i in range(args.pairs):
            order = routes if i % 2 == 0 else list(reversed(routes))
            pair: dict[str, Any] = {}
            for route in order:
                image, warm = picture(i, size), picture(1000 + i, size)
                pair[route] = trio.run(timed, loaded, route, image, warm, args.max_tokens, options)
            pairs.append(pair)
            print(json.dumps({"pair": i, **pair}), flush=True)
    report = {
        "command": " ".join(["python -m bench.media_lone", *argv]),
        "shape": args.shape,
        "settings": "as served" if args.as_served else "GPU-like (module docstring)",
        "pairs": pairs,
        "summary": summary(pairs, routes),
    }
    print(json.dumps(report["summary"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


#: the figures whose within-pair ratios against `lane` are reported
RATIOS = ("ttft_ms", "decode_tok_s", "decode_cpu_us_per_token", "step_us", "step_cpu_us", "loop_us")


def summary(pairs: list[dict[str, Any]], routes: list[str]) -> dict[str, Any]:
    """Medians per route, and within-pair ratios against `lane`."""
    out: dict[str, Any] = {}
    keys = (
        "ttft_ms",
        "decode_tok_s",
        "to_vision_ms",
        "vision_ms",
        "vision_to_first_token_ms",
        "first_token_to_consumer_ms",
        "decode_cpu_us_per_token",
        "step_us",
        "step_cpu_us",
        "loop_us",
    )
    for route in routes:
        medians: dict[str, Any] = {}
        for key in keys:
            values = [p[route][key] for p in pairs if key in p[route]]
            if values:
                medians[key] = round(statistics.median(values), 3)
        if route != "lane" and "lane" in routes:
            for key in RATIOS:
                ratios = [p[route][key] / p["lane"][key] for p in pairs if key in p[route]]
                if ratios:
                    medians[f"{key}_over_lane"] = round(statistics.median(ratios), 3)
        out[route] = medians
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
