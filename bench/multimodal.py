"""Time to first token and decode speed with an image and with a video: trio-mlx's engine API
beside mlx-vlm's own `stream_generate`, interleaved, on one synthetic model.

    python -m bench.multimodal --shape qwen2-vl-2b --repeats 3 --out docs/benchmarks/mm.json
    python -m bench.multimodal --shape tiny --repeats 1          # a smoke run on the CPU

The model is random-weight (tests/tiny_vlm.py's recipe at a real shape: `qwen2-vl-2b`,
Qwen2-VL-2B's text model and 32-block vision tower; `qwen2.5-vl-3b`, Qwen2.5-VL-3B's text model,
hidden 2048, 36 layers, and its windowed 32-block tower, which dies with SIGFPE on the H200 with
MLX 0.32.4 in both systems; bf16) with SmolLM2's tokenizer plus the vision tokens (vocabulary
49,156 rather than 151,936: the output layer is smaller than the real model's; say so with any
figure). Cases: one 448x448 image; a 16-frame 448x448 video at 2 frames a second (both systems
sample 2 a second). EOS is ignored (`max_tokens` tokens each). `--systems` picks the sides and
their order: `mlx-vlm`, `engine`, and `engine-mrope` (the engine with the fused rope for text
positions off: mlx-vlm's MRoPE at every position, `multimodal.text_rope`). Prints a JSON object per
(case, system, repeat) and a summary table (medians).
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

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"model_type": "qwen2_vl"},
    "qwen2-vl-2b": {  # Qwen2-VL-2B's text model and its 32-block vision tower (full attention)
        "model_type": "qwen2_vl",
        "text": {
            "hidden_size": 1536,
            "num_hidden_layers": 28,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "sliding_window": 32768,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": True,
        },
        "vision": {
            "depth": 32,
            "embed_dim": 1280,
            "hidden_size": 1536,
            "num_heads": 16,
            "mlp_ratio": 4,
        },
        "max_pixels": 448 * 448,
        "bf16": True,
    },
    "qwen2.5-vl-3b": {
        "model_type": "qwen2_5_vl",
        "text": {
            "hidden_size": 2048,
            "num_hidden_layers": 36,
            "intermediate_size": 11008,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "sliding_window": 32768,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": True,
        },
        "vision": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "out_hidden_size": 2048,
            "num_heads": 16,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
        },
        "max_pixels": 448 * 448,
        "bf16": True,
    },
}


NAMES = {
    "mlx-vlm": "mlx-vlm stream_generate",
    "engine": "trio-mlx engine",
    "engine-mrope": "trio-mlx engine, MRoPE at text positions",
}


def build(shape: str, out: Path) -> Path:
    import mlx.core as mx

    from tiny_vlm import build_tiny_vlm

    spec = SHAPES[shape]
    return build_tiny_vlm(
        out,
        model_type=spec["model_type"],
        text=spec.get("text"),
        vision=spec.get("vision"),
        max_pixels=spec.get("max_pixels", 784 * 64),
        dtype=mx.bfloat16 if spec.get("bf16") else None,
    )


def media(tmp: Path, size: int, frames: int) -> tuple[Any, Path]:
    import cv2
    from PIL import Image

    rng = np.random.RandomState(0)
    picture = Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8))
    video = tmp / "clip.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 2, (size, size))
    for _ in range(frames):
        writer.write(rng.randint(0, 256, (size, size, 3), dtype=np.uint8))
    writer.release()
    return picture, video


def run_mlx_vlm(
    model_dir: Path, picture: Any, video: Path | None, max_tokens: int
) -> dict[str, float]:
    from mlx_vlm import stream_generate
    from mlx_vlm.utils import load

    model, processor = load(str(model_dir))
    kind = "video" if video is not None else "image"
    templated = [
        {"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Describe it."}]}
    ]
    prompt = processor.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    began = time.perf_counter()
    first = None
    count = 0
    kwargs: dict[str, Any] = {"video": [str(video)]} if video is not None else {"image": [picture]}
    for _chunk in stream_generate(
        model, processor, prompt, max_tokens=max_tokens, temperature=0.0, **kwargs
    ):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"ttft_ms": (first - began) * 1e3, "decode_tps": (count - 1) / max(end - first, 1e-9)}


async def run_engine(
    engine: Any, picture: Any, video: Path | None, max_tokens: int
) -> dict[str, float]:
    messages = [{"role": "user", "content": "Describe it."}]
    kwargs: dict[str, Any] = (
        {"videos": [str(video)]} if video is not None else {"images": [picture]}
    )
    await engine.clear_runtime_caches()  # no prefix or vision cache: a first request each time
    engine._runner.vision_cache.clear()
    began = time.perf_counter()
    first = None
    last = None
    async for out in engine.stream_chat(
        messages,
        max_tokens=max_tokens,
        temperature=0.0,
        logit_bias={t: -100.0 for t in engine.info.eos_token_ids},
        **kwargs,
    ):
        if out.new_text and first is None:
            first = time.perf_counter()
        last = out
    end = time.perf_counter()
    assert first is not None and last is not None
    return {
        "ttft_ms": (first - began) * 1e3,
        "decode_tps": (last.completion_tokens - 1) / max(end - first, 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-3b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--systems", default="mlx-vlm,engine", help="which sides to run, in this order"
    )
    args = parser.parse_args()
    systems = args.systems.split(",")

    import trio

    import trio_mlx
    from trio_mlx.engine.loading import load_model
    from trio_mlx.multimodal.media import MediaPolicy

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build(args.shape, tmp / "model")
        size = args.size if args.shape != "tiny" else 56
        picture, video = media(tmp, size, args.frames)

        loaded = load_model(model_dir) if {"engine", "engine-mrope"} & set(systems) else None

        async def engine_side(case: str, repeat: int, system: str) -> None:
            policy = MediaPolicy(video_max_frames=args.frames, video_fps=2.0)
            assert loaded is not None
            switch = loaded.multimodal.text_rope
            if switch is not None:
                switch.enabled = system == "engine"
            async with trio_mlx.open_engine(
                model_dir, media=policy, loader=lambda _spec: loaded
            ) as engine:
                for _ in range(2):  # warm: shapes, kernels
                    await run_engine(engine, picture, video if case == "video" else None, 4)
                result = await run_engine(
                    engine, picture, video if case == "video" else None, args.max_tokens
                )
            name = NAMES[system]
            rows.append({"case": case, "system": name, "repeat": repeat, **result})
            print(json.dumps(rows[-1]), flush=True)

        for repeat in range(args.repeats):
            for case in ("image", "video"):
                clip = video if case == "video" else None
                for system in systems:
                    if system in ("engine", "engine-mrope"):
                        trio.run(engine_side, case, repeat, system)
                        continue
                    run_mlx_vlm(model_dir, picture, clip, 4)  # warm
                    result = run_mlx_vlm(model_dir, picture, clip, args.max_tokens)
                    rows.append(
                        {"case": case, "system": "mlx-vlm stream_generate", "repeat": repeat}
                        | result
                    )
                    print(json.dumps(rows[-1]), flush=True)
    print("\n| case | system | TTFT ms | decode tok/s |\n| --- | --- | --- | --- |")
    for case in ("image", "video"):
        for system in NAMES.values():
            mine = [r for r in rows if r["case"] == case and r["system"] == system]
            if not mine:
                continue
            ttft = statistics.median(r["ttft_ms"] for r in mine)
            tps = statistics.median(r["decode_tps"] for r in mine)
            print(f"| {case} | {system} | {ttft:.1f} | {tps:.1f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
