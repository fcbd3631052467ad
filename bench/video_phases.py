"""Where a video request's time to first token goes, in trio-mlx's engine and in mlx-vlm's
`stream_generate`, phase by phase, on one model and one clip (interleaved repeats, medians).

    python -m bench.video_phases --repeats 3                      # tiny model, 448x448 frames
    python -m bench.video_phases --text-hidden 512 --vision-embed 256 --vision-depth 8

The request is `bench.multimodal`'s video case (a 16-frame 448x448 MJPEG clip at 2 frames a
second, "Describe it.", greedy; the engine with no prefix or vision cache), timed from the call to
the first token ("first text": the engine's first output with a token, mlx-vlm's first chunk).
Both sides run with timers wrapped around their steps: the preparation (from the call to the
media ready for the model: the video's decoding and sampling, the processor, on the engine the
template, the media hashes and the preparer), the hand-off to the vision step, the vision step
(the arrays into MLX, the vision tower, the merge into the prompt's embeddings, evaluated:
`embed_prompt` on the engine, `get_input_embeddings` with an `mx.eval` after it on mlx-vlm), then
the prefill and the first token (on the engine its batch's prefill chunks and first decode step,
timed apart). The model is tests/tiny_vlm.py's recipe with the processor's
`max_pixels` at 448x448 (the video's 16 frames share it: 512 patches, 128 tokens); the flags
give it larger text and vision sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench.multimodal import media


class Phases:
    """Seconds per phase name, summed over calls, and the first time each mark was reached
    (seconds from `t0`), while `recording`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.recording = False
        self.t0 = 0.0
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        if self.recording:
            with self._lock:
                self.totals[name] += seconds

    def mark(self, name: str) -> None:
        if self.recording:
            with self._lock:
                self.totals.setdefault("@" + name, time.perf_counter() - self.t0)

    @contextlib.contextmanager
    def run(self) -> Iterator[dict[str, float]]:
        self.totals = defaultdict(float)
        self.t0 = time.perf_counter()
        self.recording = True
        try:
            yield self.totals
        finally:
            self.recording = False


PHASES = Phases()


def timed(name: str, fn: Callable[..., Any], *, mark: bool = False) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        if mark:
            PHASES.mark(name + " begins")
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES.add(name, time.perf_counter() - began)
            if mark:
                PHASES.mark(name + " ends")

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def patch(owner: Any, attr: str, name: str, *, mark: bool = False) -> None:
    setattr(owner, attr, timed(name, getattr(owner, attr), mark=mark))


def instrument_engine(loaded: Any) -> None:
    import trio_mlx.actors.engine_prepare as engine_prepare
    import trio_mlx.multimodal.joining as joining
    import trio_mlx.multimodal.prepare as prepare
    import trio_mlx.multimodal.vision as vision
    from trio_mlx.actors.media_lane import MediaLane
    from trio_mlx.actors.runner import Runner
    from trio_mlx.engine.batch import BatchDecoder
    from trio_mlx.preparation import RequestPreparer

    prepare_chat = engine_prepare.prepare_multimodal_chat

    async def preparation(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return await prepare_chat(*args, **kwargs)
        finally:
            PHASES.add("preparation (all)", time.perf_counter() - began)
            PHASES.mark("preparation (all) ends")

    engine_prepare.prepare_multimodal_chat = preparation
    patch(prepare, "load_media", "read file")
    patch(prepare, "decode_video", "decode video")
    for attr in ("media_hashes",) if hasattr(prepare, "media_hashes") else ("_hash_arrays",):
        patch(prepare, attr, "hash media")  # before: the media key's and the cache key's hashes
    patch(RequestPreparer, "_prepare", "preparer")
    processor = loaded.multimodal.processing.processor
    owner = prepare.template_owner(processor)
    owner.apply_chat_template = timed("chat template", owner.apply_chat_template)
    patch(Runner, "submit", "submit", mark=True)
    patch(MediaLane, "add", "lane add (restore)", mark=True)
    patch(vision, "_compute_features", "vision tower")
    patch(joining, "embed_prompt", "vision step (all)", mark=True)
    model = loaded.multimodal.model
    model.get_input_embeddings = timed("merge embeddings", model.get_input_embeddings)
    patch(BatchDecoder, "prefill", "prefill chunks", mark=True)
    decode = BatchDecoder.decode

    def first_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        """The first decode step after the request's prefill (its first token)."""
        began = time.perf_counter()
        out = decode(self, *args, **kwargs)
        if "@prefill chunks ends" in PHASES.totals and "first decode" not in PHASES.totals:
            PHASES.add("first decode", time.perf_counter() - began)
            PHASES.mark("first decode ends")
        return out

    BatchDecoder.decode = first_decode  # type: ignore[method-assign]


def instrument_shared(processor_type: type) -> None:
    """Class-level wrappers both sides go through (installed once)."""
    patch(processor_type, "__call__", "processor")


def instrument_mlx_vlm() -> None:
    import importlib

    import mlx_vlm.utils as utils

    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    patch(utils, "load_video", "decode video")
    patch(dispatch, "prepare_inputs", "preparation (all)", mark=True)


def instrument_mlx_vlm_model(model: Any) -> None:
    embed = model.get_input_embeddings

    def merge(*args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        began = time.perf_counter()
        PHASES.mark("vision step (all) begins")
        out = embed(*args, **kwargs)
        mx.eval([a for a in vars(out).values() if isinstance(a, mx.array)])
        PHASES.add("vision step (all)", time.perf_counter() - began)
        PHASES.mark("vision step (all) ends")
        return out

    model.get_input_embeddings = merge


async def engine_ttft(engine: Any, video: Path, max_tokens: int) -> float:
    """`bench.multimodal.run_engine`'s request (no prefix or vision cache), timed from the call
    (`PHASES.t0`) to the first text."""
    await engine.clear_runtime_caches()
    engine._runner.vision_cache.clear()
    PHASES.t0 = began = time.perf_counter()
    first = None
    async for out in engine.stream_chat(
        [{"role": "user", "content": "Describe it."}],
        max_tokens=max_tokens,
        temperature=0.0,
        logit_bias={t: -100.0 for t in engine.info.eos_token_ids},
        videos=[str(video)],
    ):
        if out.new_tokens and first is None:
            first = time.perf_counter()
            PHASES.mark("first text")
    assert first is not None
    return (first - began) * 1e3


def mlx_vlm_ttft(model_dir: Path, video: Path, max_tokens: int) -> float:
    """`bench.multimodal.run_mlx_vlm`'s request, timed from `stream_generate`'s call."""
    from mlx_vlm import stream_generate
    from mlx_vlm.utils import load

    model, processor = load(str(model_dir))
    templated = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe it."}]}
    ]
    prompt = processor.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    PHASES.t0 = began = time.perf_counter()
    first = None
    for _chunk in stream_generate(
        model, processor, prompt, max_tokens=max_tokens, temperature=0.0, video=[str(video)]
    ):
        if first is None:
            first = time.perf_counter()
            PHASES.mark("first text")
    assert first is not None
    return (first - began) * 1e3


def split(row: dict[str, float]) -> dict[str, float]:
    """One row's phases, the same on both sides: preparation (the call to the media ready for
    the model: video decoding, the processor, hashing), hand-off (to the vision step's start),
    vision step (arrays to MLX, the tower, the merge into the embeddings, evaluated), prefill
    and first token (to the first text)."""
    prepared = row["@preparation (all) ends"]
    vision_began, vision_ended = row["@vision step (all) begins"], row["@vision step (all) ends"]
    return {
        "TTFT": row["ttft_ms"],
        "preparation": prepared,
        "  decode video": row.get("decode video", 0.0),
        "  processor": row.get("processor", 0.0),
        "  hash media": row.get("hash media", 0.0),
        "hand-off": vision_began - prepared,
        "vision step": vision_ended - vision_began,
        "prefill + first token": row["@first text"] - vision_ended,
        "  prefill chunks": row.get("prefill chunks", float("nan")),
        "  first decode step": row.get("first decode", float("nan")),
    }


def print_split(rows: list[dict[str, Any]]) -> None:
    """Medians per phase and system (ms), and ours over mlx-vlm's."""
    medians: dict[str, dict[str, float]] = {}
    for system in ("mlx-vlm", "engine"):
        splits = [split(r) for r in rows if r["system"] == system]
        if splits:
            medians[system] = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    pairs = list(
        zip(
            [r for r in rows if r["system"] == "engine"],
            [r for r in rows if r["system"] == "mlx-vlm"],
            strict=False,
        )
    )
    print("\n| phase (median ms) | mlx-vlm | trio-mlx engine |\n| --- | --- | --- |")
    for name in medians.get("engine", {}):
        cells = [f"{medians[s][name]:.1f}" if s in medians else "" for s in ("mlx-vlm", "engine")]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    if pairs:
        ratios = [e["ttft_ms"] / m["ttft_ms"] for e, m in pairs]
        print(
            f"TTFT ours / mlx-vlm's, per interleaved pair: {[round(x, 3) for x in ratios]}, "
            f"median {statistics.median(ratios):.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--text-hidden", type=int, default=None)
    parser.add_argument("--text-layers", type=int, default=None)
    parser.add_argument("--vision-depth", type=int, default=None)
    parser.add_argument("--vision-embed", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import mlx.core as mx
    import trio

    import trio_mlx
    from tiny_vlm import build_tiny_vlm
    from trio_mlx.engine.loading import load_model
    from trio_mlx.multimodal.media import MediaPolicy

    text: dict[str, Any] = {}
    if args.text_hidden:
        text |= {"hidden_size": args.text_hidden, "intermediate_size": 4 * args.text_hidden}
        text |= {"num_attention_heads": max(4, args.text_hidden // 64)}
        text |= {"num_key_value_heads": 2}
    if args.text_layers:
        text["num_hidden_layers"] = args.text_layers
    vision: dict[str, Any] = {}
    if args.vision_depth:
        vision["depth"] = args.vision_depth
    if args.vision_embed:
        vision |= {"embed_dim": args.vision_embed, "num_heads": max(2, args.vision_embed // 64)}
    if text.get("hidden_size"):
        vision["hidden_size"] = text["hidden_size"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_vlm(
            tmp / "model",
            text=text or None,
            vision=vision or None,
            max_pixels=args.size * args.size,
        )
        _picture, video = media(tmp, args.size, args.frames)
        loaded = load_model(model_dir)
        instrument_engine(loaded)
        instrument_mlx_vlm()
        instrument_shared(type(loaded.multimodal.processing.processor))

        import mlx_vlm.utils as vlm_utils

        load = vlm_utils.load

        def load_instrumented(path: str) -> Any:
            model, processor = load(path)
            instrument_mlx_vlm_model(model)
            return model, processor

        sys.modules["mlx_vlm.utils"].load = load_instrumented  # type: ignore[attr-defined]

        async def engine_side() -> dict[str, float]:
            policy = MediaPolicy(video_max_frames=args.frames, video_fps=2.0)
            async with trio_mlx.open_engine(
                model_dir, media=policy, loader=lambda _spec: loaded
            ) as engine:
                for _ in range(2):
                    await engine_ttft(engine, video, 2)
                with PHASES.run() as totals:
                    ttft = await engine_ttft(engine, video, 2)
            return {"ttft_ms": ttft} | {k: v * 1e3 for k, v in sorted(totals.items())}

        def mlx_vlm_side() -> dict[str, float]:
            mlx_vlm_ttft(model_dir, video, 2)
            with PHASES.run() as totals:
                ttft = mlx_vlm_ttft(model_dir, video, 2)
            return {"ttft_ms": ttft} | {k: v * 1e3 for k, v in sorted(totals.items())}

        for repeat in range(args.repeats):
            for system in ("mlx-vlm", "engine"):
                mx.clear_cache()
                row = trio.run(engine_side) if system == "engine" else mlx_vlm_side()
                rows.append({"system": system, "repeat": repeat} | row)
                rounded = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
                print(json.dumps({"system": system} | rounded), flush=True)
    print_split(rows)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
