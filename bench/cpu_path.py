"""The CPU path: `trio-mlx serve` on the bundled model against raw mlx-lm on its 4-bit weights.

    python -m bench.cpu_path --repeats 3 --out docs/benchmarks/DATE-cpu-path

One run, interleaved per repeat, each cell a fresh random prompt of `--prompt-tokens` token ids
(no prefix-cache hit) and `--max-tokens` greedy tokens:
- `raw mlx-lm 4-bit`: `mlx_lm.load` on the converted bundled model, `generate_step`, in a fresh
  process (what `pip install mlx-lm` gives: MLX's reference BLAS, the quantized kernels);
- `raw mlx-lm float32 + OpenBLAS`: the same weights dequantized, with trio-mlx's BLAS arrangement
  (`engine.cpu_blas.use_openblas`), in a fresh process: the floor of the fast path;
- `trio-mlx serve`: the real CLI with its defaults, one process for the whole run, a streamed
  `/v1/completions` request of token ids over HTTP.

Prefill tok/s is prompt tokens over the time to the first token (for HTTP, as the client sees
it); decode tok/s is tokens after the first over the time after the first. A request that ends
early (EOS) reports the tokens it had. Writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

RAW = r"""
import json, sys, time
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from trio_mlx.engine.model_spec import resolve_model_path
mode, ids, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model, _ = mlx_lm.load(str(resolve_model_path(None).path))
if mode == "float32":
    from mlx_lm.utils import dequantize_model
    from trio_mlx.engine.cpu_blas import use_openblas
    print(use_openblas().describe(), file=sys.stderr)
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
for _ in generate_step(mx.array(ids[:16]), model, max_tokens=2):  # warm the kernels
    pass
start = time.perf_counter()
times = []
for _token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
    times.append(time.perf_counter())
print(json.dumps({"ttft": times[0] - start, "times": [t - start for t in times]}))
"""


def raw_cell(mode: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRIO_MLX_BLAS"}
    done = subprocess.run(
        [sys.executable, "-c", RAW, mode, json.dumps(ids), str(max_tokens)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=True,
    )
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return _figures(len(ids), out["ttft"], out["times"])


def http_cell(url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    times: list[float] = []
    with httpx.Client(base_url=url, timeout=900) as http:
        start = time.perf_counter()
        with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter() - start)
    return _figures(len(ids), times[0], times)


def _figures(prompt: int, ttft: float, times: list[float]) -> dict[str, Any]:
    decoded = len(times) - 1
    decode = decoded / (times[-1] - times[0]) if decoded > 0 else 0.0
    return {
        "ttft_s": ttft,
        "prefill_tps": prompt / ttft,
        "decode_tps": decode,
        "tokens": len(times),
    }


def start_server(log_path: Path) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if k != "TRIO_MLX_BLAS"}
    env["PYTHONUNBUFFERED"] = "1"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_mlx", "serve", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stderr is not None
    url = None
    for line in process.stderr:
        log.write(line)
        if "listening on " in line:
            url = line.strip().split("listening on ", 1)[1].split()[0]
            break
    if url is None:
        raise RuntimeError(f"the server did not start; see {log_path}")
    return process, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="NAME: writes NAME.json, .md")
    args = parser.parse_args()
    rng = random.Random(0)
    load_before = os.getloadavg()
    server, url = start_server(args.out.with_suffix(".log"))
    rows: list[dict[str, Any]] = []
    try:
        http_cell(url, [rng.randrange(100, 40000) for _ in range(16)], 2)  # warm the server
        for repeat in range(args.repeats):
            for system in ("raw mlx-lm 4-bit", "raw mlx-lm float32 + OpenBLAS", "trio-mlx serve"):
                ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
                if system == "trio-mlx serve":
                    cell = http_cell(url, ids, args.max_tokens)
                else:
                    mode = "4bit" if "4-bit" in system else "float32"
                    cell = raw_cell(mode, ids, args.max_tokens)
                rows.append({"system": system, "repeat": repeat, **cell})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = {
        "command": "python -m bench.cpu_path " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_1min": [load_before[0], os.getloadavg()[0]],
        },
        "rows": rows,
    }
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(report, args) + "\n")
    print(render(report, args))


def render(report: dict[str, Any], args: argparse.Namespace) -> str:
    rows = report["rows"]
    base = {r["repeat"]: r for r in rows if r["system"] == "raw mlx-lm 4-bit"}
    lines = [
        f"# CPU path: {args.prompt_tokens}-token prefill, {args.max_tokens} tokens, "
        f"{args.repeats} repeats",
        "",
        f"`{report['command']}` on {report['machine']['platform']}, "
        f"{report['machine']['cpus']} CPUs, shared: 1-minute load average "
        f"{report['machine']['load_average_1min'][0]:.1f} at the start and "
        f"{report['machine']['load_average_1min'][1]:.1f} at the end; compare ratios within "
        "the run.",
        "",
        "| system | prefill tok/s | decode tok/s | prefill × raw 4-bit | decode × raw 4-bit |",
        "| --- | --- | --- | --- | --- |",
    ]
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        prefill = statistics.median(r["prefill_tps"] for r in mine)
        decode = statistics.median(r["decode_tps"] for r in mine)
        px = statistics.median(r["prefill_tps"] / base[r["repeat"]]["prefill_tps"] for r in mine)
        dx = statistics.median(r["decode_tps"] / base[r["repeat"]]["decode_tps"] for r in mine)
        lines.append(f"| {system} | {prefill:.1f} | {decode:.1f} | {px:.1f} | {dx:.2f} |")
    lines += ["", "Medians over the repeats; ratios within each repeat, then the median."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
