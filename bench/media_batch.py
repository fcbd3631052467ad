"""Many requests with images at once: decoding in the batch (`multimodal/joining.py`) against
each beside it in the media lane, through the engine API, on one synthetic vision model.

    python -m bench.media_batch --shape qwen2-vl-2b --concurrency 1,4,16 --out $OUT/mb.json  # H200
    python -m bench.media_batch --shape tiny --concurrency 4 --repeats 1                    # CPU

Per cell (concurrency N, mode): N greedy chats, each with a different 448x448 image (56x56 on the
tiny shape), start together on one engine (`max_num_seqs` N, the GPU defaults otherwise, EOS
banned: `--max-tokens` each); reported: time to first token p50 / max over the N, and the
aggregate decode rate (completion tokens over the wall time from the start to the last end).
Modes alternate cell by cell, the weights loaded once: `join` (the default: media rows join the
batch after their prefill) and `lane` (every request with media decodes beside the batch, one
forward pass each a step: how it was before). A warm-up round of the same shape precedes each
cell; the vision cache and prefix cache are cleared before each timed round, so each request
encodes its image and prefills. Random weights: speed only; the model's vocabulary is SmolLM2's
plus the vision tokens (see bench.multimodal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def picture(seed: int, size: int) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


async def cell(engine: Any, images: list[Any], max_tokens: int) -> dict[str, float]:
    import trio

    ban = {t: -100.0 for t in engine.info.eos_token_ids}
    firsts: list[float] = []
    counts: list[int] = []
    began = time.perf_counter()

    async def one(image: Any) -> None:
        first = None
        last = None
        async for out in engine.stream_chat(
            [{"role": "user", "content": "Describe it."}],
            images=[image],
            max_tokens=max_tokens,
            temperature=0.0,
            logit_bias=ban,
        ):
            if first is None and out.new_tokens:
                first = time.perf_counter() - began
            last = out
        assert first is not None and last is not None
        firsts.append(first)
        counts.append(last.completion_tokens)

    async with trio.open_nursery() as nursery:
        for image in images:
            nursery.start_soon(one, image)
    wall = time.perf_counter() - began
    return {
        "ttft_p50_ms": 1e3 * statistics.median(firsts),
        "ttft_max_ms": 1e3 * max(firsts),
        "aggregate_tok_s": sum(counts) / wall,
    }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2-vl-2b")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import trio
    from bench.multimodal import build

    import trio_mlx
    from trio_mlx.actors import media_lane
    from trio_mlx.engine.loading import load_model

    joins = media_lane.can_join
    rows: list[dict[str, Any]] = []
    size = 56 if args.shape == "tiny" else 448
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(args.shape, Path(tmp) / "model")
        loaded = load_model(model_dir)
        for repeat in range(args.repeats):
            for n in (int(c) for c in args.concurrency.split(",")):
                for mode in ("join", "lane"):
                    media_lane.can_join = joins if mode == "join" else (lambda *a: False)

                    async def run(n: int = n, repeat: int = repeat) -> dict[str, float]:
                        async with trio_mlx.open_engine(
                            "model", loader=lambda _spec: loaded, max_num_seqs=max(n, 2)
                        ) as engine:
                            warm = [picture(1000 + i, size) for i in range(n)]
                            await cell(engine, warm, 4)
                            await engine.clear_runtime_caches()
                            engine._runner.vision_cache.clear()
                            images = [picture(repeat * 100 + i, size) for i in range(n)]
                            return await cell(engine, images, args.max_tokens)

                    result = trio.run(run)
                    rows.append({"concurrency": n, "mode": mode, "repeat": repeat, **result})
                    print(json.dumps(rows[-1]), flush=True)
        media_lane.can_join = joins
    print("\n| streams | mode | TTFT p50 ms | aggregate tok/s |\n| --- | --- | --- | --- |")
    for n in sorted({r["concurrency"] for r in rows}):
        for mode in ("join", "lane"):
            mine = [r for r in rows if r["concurrency"] == n and r["mode"] == mode]
            ttft = statistics.median(r["ttft_p50_ms"] for r in mine)
            rate = statistics.median(r["aggregate_tok_s"] for r in mine)
            print(f"| {n} | {mode} | {ttft:.1f} | {rate:.1f} |")
    report = {"command": " ".join(["python -m bench.media_batch", *argv]), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
