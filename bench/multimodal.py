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
sample 2 a second: the same 16 frames, the same pixels and prompt, 128 video tokens with the
processor's `max_pixels` of 448x448 shared by the frames). TTFT: from the call to the first token
(mlx-vlm's first chunk, the engine's first output with a token, whether or not it has text yet).
EOS is ignored (`max_tokens` tokens each). `--systems` picks the sides and their order:
`mlx-vlm`, `engine`, `engine-mrope` (the engine with the fused rope for text positions off:
mlx-vlm's MRoPE at every position, `multimodal.text_rope`) and `vllm-mlx` (vllm-mlx's server with
`--mllm`, from `--vllm-python`: a streaming chat completion with the media as a data URL, fresh
media each time since it caches what it has seen, EOS banned by logit bias, video sampled per
request at the same 2 frames a second). Prints a JSON object per (case, system, repeat) and a
summary table (medians).
"""

from __future__ import annotations

import argparse
import contextlib
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
    "vllm-mlx": "vllm-mlx server (HTTP)",
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


def media(tmp: Path, size: int, frames: int, seed: int = 0) -> tuple[Any, Path]:
    import cv2
    from PIL import Image

    rng = np.random.RandomState(seed)
    picture = Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8))
    video = tmp / f"clip-{seed}.avi"
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


def data_url(picture: Any, video: Path | None) -> tuple[str, str]:
    """The image (PNG) or the video file as a data URL, and its content part's type."""
    import base64
    import io

    if video is not None:
        encoded = base64.b64encode(video.read_bytes()).decode()
        return f"data:video/x-msvideo;base64,{encoded}", "video_url"
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}", "image_url"


def run_server(
    base_url: str,
    model: str,
    picture: Any,
    video: Path | None,
    max_tokens: int,
    frames: int,
    eos: list[int],
) -> dict[str, float]:
    """One streaming chat completion with the image or the video as a data URL (vllm-mlx's
    server: its per-request `video_fps` / `video_max_frames` set as the other sides sample)."""
    import httpx

    url, kind = data_url(picture, video)
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": kind, kind: {"url": url}},
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {str(t): -100.0 for t in eos},
    }
    if video is not None:
        body |= {"video_fps": 2.0, "video_max_frames": frames}
    began = time.perf_counter()
    first = None
    count = 0
    lines: list[str] = []
    with httpx.stream("POST", base_url + "/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            lines.append(line)
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                count = int(event["usage"].get("completion_tokens") or count)
            choices = event.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"no text in the reply: {lines[:12]}")
    return {"ttft_ms": (first - began) * 1e3, "decode_tps": (count - 1) / max(end - first, 1e-9)}


class VllmMlx:
    """vllm-mlx's server on the model (`--mllm`), started once, from `--vllm-python` (its own
    site: it needs mlx-lm<0.32; `bench/gpu_run.sh install-vllm` on the GPU host)."""

    def __init__(self, python: str, model_dir: Path, workdir: Path) -> None:
        from bench.compare import Server, free_port

        port = free_port()
        argv = [python, "-m", "vllm_mlx.cli", "serve", str(model_dir), "--mllm"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--max-tokens", "4096"]
        log = workdir / "vllm-mlx-multimodal.log"
        self.server = Server("vllm_mlx", argv, port, log, model_dir.name)
        self.model = ""

    def __enter__(self) -> VllmMlx:
        import trio
        from bench.compare import served_name, server_env, wait_ready

        self.server.start(server_env())
        try:
            trio.run(wait_ready, self.server, 600.0)
            self.model = trio.run(served_name, self.server)
        except BaseException:
            self.server.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


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
        if out.new_tokens and first is None:  # its first token, as mlx-vlm's side counts
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
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trio-mlx-bench"))
    parser.add_argument(
        "--vllm-python",
        default="/tmp/vllm-python",
        help="the Python with vllm-mlx for the vllm-mlx side (bench/gpu_run.sh install-vllm)",
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

        config = json.loads((model_dir / "config.json").read_text())
        eos = config["eos_token_id"]
        eos_ids = [eos] if isinstance(eos, int) else list(eos)

        def one_cell(case: str, repeat: int, system: str, vllm: VllmMlx | None) -> None:
            clip = video if case == "video" else None
            if system in ("engine", "engine-mrope"):
                trio.run(engine_side, case, repeat, system)
                return
            if system == "vllm-mlx":
                assert vllm is not None
                # media of their own each time: vllm-mlx keeps caches of what it has seen
                fresh, fresh_clip = media(tmp, size, args.frames, seed=1 + 2 * repeat)
                warm, warm_clip = media(tmp, size, args.frames, seed=2 + 2 * repeat)
                url, model, frames = vllm.server.base_url, vllm.model, args.frames
                try:
                    run_server(url, model, warm, warm_clip if clip else None, 4, frames, eos_ids)
                    clip = fresh_clip if clip else None
                    result = run_server(url, model, fresh, clip, args.max_tokens, frames, eos_ids)
                except RuntimeError as exc:  # the server's own failure, said in the row
                    result = {"error": str(exc)[:500], "log": vllm.server.log_tail(3)}
            else:
                run_mlx_vlm(model_dir, picture, clip, 4)  # warm
                result = run_mlx_vlm(model_dir, picture, clip, args.max_tokens)
            rows.append({"case": case, "system": NAMES[system], "repeat": repeat} | result)
            print(json.dumps(rows[-1]), flush=True)

        with contextlib.ExitStack() as stack:
            vllm = None
            if "vllm-mlx" in systems:
                args.workdir.mkdir(parents=True, exist_ok=True)
                vllm = stack.enter_context(VllmMlx(args.vllm_python, model_dir, args.workdir))
            for repeat in range(args.repeats):
                for case in ("image", "video"):
                    for system in systems:
                        one_cell(case, repeat, system, vllm)
    print("\n| case | system | TTFT ms | decode tok/s |\n| --- | --- | --- | --- |")
    for case in ("image", "video"):
        for system in NAMES.values():
            mine = [r for r in rows if r["case"] == case and r["system"] == system]
            if any("error" in r for r in mine):
                print(f"| {case} | {system} | failed: see the rows | |")
            mine = [r for r in mine if "error" not in r]
            if not mine:
                continue
            ttft = statistics.median(r["ttft_ms"] for r in mine)
            tps = statistics.median(r["decode_tps"] for r in mine)
            print(f"| {case} | {system} | {ttft:.1f} | {tps:.1f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
