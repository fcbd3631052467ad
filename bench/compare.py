"""trio-mlx side by side with raw mlx-lm and the peer servers, on one model, in one run.

    python -m bench.compare --model tiny --systems raw,engine,http,mlx_lm_server,vllm_mlx \\
        --prompt-tokens 128,2048 --max-tokens 256 --concurrency 1,4,16 --repeats 3 \\
        --out docs/benchmarks/<name>

Systems (all on the same model directory, greedy, the same prompts):
- `raw`: mlx-lm `generate_step` in this process (the floor). Concurrency N = N requests one after
  the other (no batching), each request's TTFT counted from the start of the burst;
- `engine`: the trio-mlx engine API (`Engine.stream_chat`) in this process, on the same loaded
  weights, admission "wait" with up to 64 waiting;
- `http`: `trio-mlx serve` (a subprocess, --admission wait --max-waiting 64 --max-wait 600);
- `mlx_lm_server`: `python -m mlx_lm.server` (a subprocess, its defaults: batching on);
- `vllm_mlx`: vllm-mlx's server from a separate venv (`--vllm-python`), skipped with the reason
  when it cannot start.
HTTP systems are driven through `/v1/chat/completions` with streaming, by the `openai` client
(`--client openai`, the default) or by a plain httpx SSE reader (`--client httpx`). Chat rather than
`/v1/completions` because every server honours `logit_bias` there: EOS gets -100 on every system,
raw mlx-lm and the engine included, so each request generates exactly `--max-tokens` tokens (a
request that does not is flagged). Each request has its own random prompt (words of the SmolLM2
vocabulary in a system message), the same prompt for every system within a cell, never reused: no
prefix-cache hits beyond the chat template's first tokens.

Order: for each repeat, for each (prompt length, concurrency) cell, every system in turn, the order
rotated from cell to cell. After one warm-up per system and shape. Everything is bounded:
`--deadline-s` for the whole measurement (cells not started by then are reported as skipped),
`--cell-timeout-s` per cell, `--server-start-timeout-s` per server. Loopback addresses only.

`--decode-pairs N` then measures decode against raw mlx-lm in N back-to-back pairs per system
(the ratio taken within each pair: on a shared GPU host raw mlx-lm's own speed swings by ±25 %
between requests minutes apart; `bench/decode_pairs.py`).

Writes OUT.json (every request's figures, machine, versions, command), OUT.md (medians over the
repeats, ratios against raw mlx-lm from the same repeat) and OUT.png. `--render OUT.json` redraws
the table and plot from a JSON written elsewhere (e.g. on a host without matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("raw", "engine", "http", "mlx_lm_server", "vllm_mlx")
SERVER_SYSTEMS = ("http", "mlx_lm_server", "vllm_mlx")
LABELS = {
    "raw": "raw mlx-lm",
    "engine": "trio-mlx engine",
    "http": "trio-mlx HTTP",
    "mlx_lm_server": "mlx_lm.server",
    "vllm_mlx": "vllm-mlx",
}


def log(message: str) -> None:
    print(message, flush=True)


# ---- per-request measurement -------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    status: int = 200
    ttft_s: float | None = None  # from the start of the burst to the first token (text)
    e2e_s: float = 0.0  # from the start of the burst to the last token
    first_s: float | None = None  # when this request's first token came, since its own start
    tokens: int = 0
    chunks: int = 0
    gaps_s: list[float] = field(default_factory=list)
    decode_s: float = 0.0  # first token to last token
    error: str | None = None
    text: str | None = None
    token_ids: list[int] | None = None

    @property
    def decode_tps(self) -> float | None:
        if not self.ok or self.tokens < 2 or self.decode_s <= 0:
            return None
        return (self.tokens - 1) / self.decode_s

    def slowest_gaps(self, count: int = 3) -> list[tuple[int, float]]:
        """The `count` longest gaps between chunks as (chunk index, ms), longest first: where in
        the stream a stall fell (chunk i arrived that long after chunk i - 1)."""
        ranked = sorted(enumerate(self.gaps_s, start=1), key=lambda gap: -gap[1])[:count]
        return [(index, round(1e3 * seconds, 2)) for index, seconds in ranked]


class Timer:
    """Token arrival bookkeeping for one request (times relative to the burst start)."""

    def __init__(self, burst_start: float) -> None:
        self.burst_start = burst_start
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.chunks = 0

    def arrived(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            assert self.last is not None
            self.gaps.append(now - self.last)
        self.last = now
        self.chunks += 1

    def result(self, tokens: int, **kw: Any) -> RequestResult:
        end = self.last if self.last is not None else time.perf_counter()
        if self.first is None:  # a 200 that carried no token (e.g. an error frame in the stream)
            kw.setdefault("error", "stream ended without a token")
        return RequestResult(
            ok=self.first is not None,
            ttft_s=None if self.first is None else self.first - self.burst_start,
            e2e_s=end - self.burst_start,
            tokens=tokens,
            chunks=self.chunks,
            gaps_s=self.gaps,
            decode_s=0.0 if self.first is None else end - self.first,
            **kw,
        )


# ---- prompts -----------------------------------------------------------------------------------


class Prompts:
    """Random chat prompts of about `n` tokens (after the chat template), distinct per seed."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else tokenizer.vocab
        self.words = sorted(
            t[1:] for t in vocab if re.fullmatch(r"\u0120[a-z]{3,10}", t)
        )  # byte-level BPE: "Ġword" is " word", one token
        self._overhead: int | None = None

    def messages(self, words: list[str], seed: int = 0) -> list[dict[str, str]]:
        # A short system message of its own (so no two requests share more than the template's
        # first tokens, and a server's system-prompt snapshot stays small), the words as the user's.
        return [
            {"role": "system", "content": f"Session {seed}."},
            {"role": "user", "content": " ".join(words)},
        ]

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if isinstance(ids, dict):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def make(self, n_tokens: int, seed: int) -> tuple[list[dict[str, str]], list[int]]:
        if self._overhead is None:
            self._overhead = len(self.ids(self.messages([])))
        rng = random.Random(seed)
        words = [rng.choice(self.words) for _ in range(max(1, n_tokens - self._overhead))]
        messages = self.messages(words, seed)
        return messages, self.ids(messages)


# ---- memory ------------------------------------------------------------------------------------


def proc_status_kb(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def gpu_memory_mb() -> dict[int, float]:
    """Per-process GPU memory from nvidia-smi (empty where there is none)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-compute-apps=pid,used_memory",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage: dict[int, float] = {}
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            pid, mb = (s.strip() for s in line.split(","))
            usage[int(pid)] = usage.get(int(pid), 0.0) + float(mb)
    return usage


def gpu_used_mb() -> float | None:
    """Memory in use on the whole GPU (all processes), where nvidia-smi can tell."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return sum(float(x) for x in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class GpuSampler:
    """Peak GPU memory per process (and of the whole GPU), sampled every second."""

    def __init__(self) -> None:
        self.enabled = shutil.which("nvidia-smi") is not None
        self.peak: dict[int, float] = {}
        self.total_peak: float | None = None  # reset per cell

    def sample(self) -> None:
        if not self.enabled:
            return
        for pid, mb in gpu_memory_mb().items():
            self.peak[pid] = max(self.peak.get(pid, 0.0), mb)
        used = gpu_used_mb()
        if used is not None:
            self.total_peak = max(self.total_peak or 0.0, used)

    async def run(self) -> None:
        import trio

        while self.enabled:
            await trio.to_thread.run_sync(self.sample)
            await trio.sleep(1.0)


# ---- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    system: str
    argv: list[str]
    port: int
    log_path: Path
    model_name: str
    proc: subprocess.Popen[bytes] | None = None
    error: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, env: dict[str, str]) -> None:
        self.log_file = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)
        self.log_file.close()

    def memory(self, gpu: GpuSampler) -> dict[str, float | None]:
        if self.proc is None:
            return {}
        hwm = proc_status_kb(self.proc.pid, "VmHWM")
        rss = proc_status_kb(self.proc.pid, "VmRSS")
        return {
            "rss_peak_mb": None if hwm is None else hwm / 1024,
            "rss_mb": None if rss is None else rss / 1024,
            "gpu_peak_mb": gpu.peak.get(self.proc.pid),
        }


async def wait_ready(server: Server, timeout_s: float) -> None:
    import httpx
    import trio

    deadline = time.monotonic() + timeout_s
    root = server.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            assert server.proc is not None
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"exited with {server.proc.returncode} while starting:\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                response = await client.get(root + "/health")
                if response.status_code == 200:
                    if server.system == "http" and response.json().get("status") not in (
                        None,
                        "ok",
                        "ready",
                    ):
                        await trio.sleep(0.25)
                        continue
                    return
            await trio.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s:\n{server.log_tail()}")


async def served_name(server: Server) -> str:
    import httpx

    if server.system == "mlx_lm_server":
        return "default_model"
    async with httpx.AsyncClient(timeout=10) as client:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            return str((await client.get(server.base_url + "/models")).json()["data"][0]["id"])
    return server.model_name


def vllm_problem(python: str) -> str | None:
    """Why vllm-mlx's server cannot run from `python` (None if it imports)."""
    if python == "none":
        return (
            "not installed (--vllm-python none): vllm-mlx needs mlx-lm<0.32 in a site of its own; "
            "on the GPU host see bench/gpu_run.sh install-vllm"
        )
    if not Path(python).exists():
        return f"no vllm-mlx venv: {python} does not exist"
    try:
        done = subprocess.run(
            [python, "-c", "import vllm_mlx.server, mlx.core, mlx_lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return "importing vllm_mlx.server took over 300 s"
    if done.returncode != 0:
        return "import vllm_mlx.server failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
    return None


def make_server(system: str, path: Path, workdir: Path, args: argparse.Namespace) -> Server:
    port = free_port()
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if system == "http":
        argv = [sys.executable, "-m", "trio_mlx", "serve", str(path), *host]
        argv += ["--admission", "wait", "--max-waiting", "64", "--max-wait", "600"]
    elif system == "mlx_lm_server":
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(path), *host]
        argv += ["--max-tokens", str(args.max_tokens)]
    elif system == "vllm_mlx":
        argv = [args.vllm_python, "-m", "vllm_mlx.cli", "serve", str(path), *host]
        argv += ["--max-tokens", str(max(args.max_tokens, 4096))]
    else:
        raise ValueError(system)
    argv += shlex.split(getattr(args, f"{system}_args") or "")
    return Server(system, argv, port, workdir / f"{system}.log", path.name)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["NO_PROXY"] = "127.0.0.1,localhost"
    return env


# ---- the five ways to run a request ------------------------------------------------------------


class Runners:
    def __init__(self, args: argparse.Namespace, loaded: Any, eos: list[int]) -> None:
        self.args = args
        self.loaded = loaded
        self.eos = eos
        self.engine: Any = None
        self.servers: dict[str, Server] = {}
        self.names: dict[str, str] = {}
        self.clients: dict[str, Any] = {}
        import mlx.core as mx

        # EOS bias for raw mlx-lm folded into a greedy sampler (argmax of logprobs + a dense bias
        # vector): passing `logits_processors` instead would make generate_step concatenate the
        # whole token history every step, a cost the engine does not pay.
        vocab = loaded.model.args.vocab_size if hasattr(loaded.model, "args") else None
        vocab = vocab or int(loaded.config.get("vocab_size"))
        bias = mx.zeros((vocab,), dtype=mx.float32).at[mx.array(eos)].add(-100.0)
        mx.eval(bias)
        self.sampler = lambda logprobs: mx.argmax(logprobs + bias, axis=-1)

    # raw mlx-lm: one request after the other
    def raw_one(self, ids: list[int], n: int, burst_start: float) -> RequestResult:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        timer = Timer(burst_start)
        tokens: list[int] = []
        for token, _ in generate_step(
            mx.array(ids), self.loaded.model, max_tokens=n, sampler=self.sampler
        ):
            tokens.append(int(token))
            timer.arrived()
        return timer.result(len(tokens), token_ids=tokens)

    async def raw(self, prompts: list[tuple[Any, list[int]]], n: int) -> list[RequestResult]:
        start = time.perf_counter()
        return [self.raw_one(ids, n, start) for _, ids in prompts]

    async def engine_one(self, messages: Any, n: int, start: float) -> RequestResult:
        import trio_mlx

        timer = Timer(start)
        tokens: list[int] = []
        try:
            async for out in self.engine.stream_chat(
                messages,
                max_tokens=n,
                temperature=0.0,
                logit_bias={t: -100.0 for t in self.eos},
            ):
                if out.new_tokens:
                    tokens.extend(out.new_tokens)
                    timer.arrived()
        except trio_mlx.EngineBusy as exc:
            return RequestResult(ok=False, status=429, error=str(exc)[:200])
        except Exception as exc:  # a failed request is a figure, not the end of the run
            return RequestResult(ok=False, status=0, error=f"{type(exc).__name__}: {exc}"[:200])
        return timer.result(len(tokens), token_ids=tokens)

    async def http_one(self, system: str, messages: Any, n: int, start: float) -> RequestResult:
        if self.args.client == "openai":
            return await self._openai_one(system, messages, n, start)
        return await self._httpx_one(system, messages, n, start)

    async def _openai_one(self, system: str, messages: Any, n: int, start: float) -> RequestResult:
        import openai

        client = self.clients[system]
        timer = Timer(start)
        usage: int | None = None
        text: list[str] = []
        try:
            stream = await client.chat.completions.create(
                model=self.names[system],
                messages=messages,
                max_tokens=n,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                logit_bias={str(t): -100 for t in self.eos},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    timer.arrived()
        except openai.APIStatusError as exc:
            return RequestResult(ok=False, status=exc.status_code, error=str(exc)[:200])
        except openai.APIError as exc:
            return RequestResult(ok=False, status=0, error=f"{type(exc).__name__}: {exc}"[:200])
        return timer.result(usage if usage is not None else timer.chunks, text="".join(text))

    async def _httpx_one(self, system: str, messages: Any, n: int, start: float) -> RequestResult:
        import httpx

        client = self.clients[system]
        body = {
            "model": self.names[system],
            "messages": messages,
            "max_tokens": n,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {str(t): -100 for t in self.eos},
        }
        timer = Timer(start)
        usage: int | None = None
        text: list[str] = []
        try:
            async with client.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:200]
                    return RequestResult(ok=False, status=response.status_code, error=detail)
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"].get("completion_tokens")
                    choices = event.get("choices") or []
                    content = choices[0].get("delta", {}).get("content") if choices else None
                    if content:
                        text.append(content)
                        timer.arrived()
        except httpx.HTTPError as exc:
            return RequestResult(ok=False, status=0, error=f"{type(exc).__name__}: {exc}"[:200])
        return timer.result(usage if usage is not None else timer.chunks, text="".join(text))

    async def run(
        self, system: str, prompts: list[tuple[Any, list[int]]], n: int
    ) -> list[RequestResult]:
        import trio

        if system == "raw":
            return await self.raw(prompts, n)
        results: list[RequestResult | None] = [None] * len(prompts)
        start = time.perf_counter()

        async def one(i: int, messages: Any) -> None:
            if system == "engine":
                results[i] = await self.engine_one(messages, n, start)
            else:
                results[i] = await self.http_one(system, messages, n, start)

        async with trio.open_nursery() as nursery:
            for i, (messages, _) in enumerate(prompts):
                nursery.start_soon(one, i, messages)
        return [r for r in results if r is not None]


# ---- figures -----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def median(values: list[float | None]) -> float | None:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else None


def cell_figures(results: list[RequestResult], wall_s: float, n: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "refused_429": sum(1 for r in results if r.status == 429),
        "errors": sum(1 for r in results if not r.ok and r.status != 429),
        "error_kinds": sorted(
            {f"{r.status}: {r.error}" for r in results if not r.ok and r.status != 429}
        ),
        "short": sum(1 for r in ok if r.tokens != n),  # generated fewer/more than max_tokens
        "ttft_ms_p50": None if not ok else 1e3 * statistics.median(r.ttft_s or 0 for r in ok),
        "ttft_ms_max": None if not ok else 1e3 * max(r.ttft_s or 0 for r in ok),
        "decode_tps_p50": median([r.decode_tps for r in ok]),
        "itl_ms_p50": None if not gaps else 1e3 * (pct(gaps, 0.5) or 0.0),
        "itl_ms_p99": None if not gaps else 1e3 * (pct(gaps, 0.99) or 0.0),
        "tokens_per_chunk": None if not ok else tokens / max(1, sum(r.chunks for r in ok)),
        "e2e_s_p50": None if not ok else statistics.median(r.e2e_s for r in ok),
        "e2e_s_max": None if not ok else max(r.e2e_s for r in ok),
        "aggregate_tps": tokens / wall_s if wall_s > 0 else None,
        "wall_s": wall_s,
        "tokens": tokens,
    }


# ---- the run -----------------------------------------------------------------------------------


def versions(args: argparse.Namespace) -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for name in (
        "mlx",
        "mlx-cpu",
        "mlx-cuda-13",
        "mlx-metal",
        "mlx-lm",
        "trio-mlx",
        "trio",
        "hypercorn",
        "quart-trio",
        "pydantic",
        "openai",
        "httpx",
        "transformers",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if rev.returncode == 0:
            out["trio-mlx git"] = rev.stdout.strip() + (" (src modified)" if dirty.stdout else "")
    if "vllm_mlx" in args.systems and Path(args.vllm_python).exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            code = (
                "from importlib import metadata as m; import json; "
                "print(json.dumps({n: m.version(n) for n in ('vllm-mlx', 'mlx', 'mlx-lm')}))"
            )
            done = subprocess.run(
                [args.vllm_python, "-c", code], capture_output=True, text=True, timeout=60
            )
            if done.returncode == 0:
                out["vllm-mlx venv"] = json.loads(done.stdout)
    return out


def machine() -> dict[str, Any]:
    import mlx.core as mx

    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mlx_device": str(mx.default_device()),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_gb"] = round(int(line.split()[1]) / 2**20, 1)
    with contextlib.suppress(Exception):
        info["mlx_device_info"] = {
            k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))
        }
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["gpus"] = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
    if os.environ.get("LD_PRELOAD"):
        info["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    return info


async def run_model(
    spec: str, args: argparse.Namespace, deadline: float, report: dict[str, Any]
) -> None:
    import trio
    from bench.models import resolve_subject, structural_copy

    import trio_mlx
    from trio_mlx.config import SERVER_PROCESS_SETTINGS
    from trio_mlx.engine.loading import load_model

    workdir = Path(args.workdir)
    t0 = time.perf_counter()
    subject = resolve_subject(spec, workdir)
    log(
        f"[{spec}] model {subject.path} ({subject.description}) ready in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    loaded = load_model(subject.path)
    eos = sorted(int(t) for t in loaded.eos_token_ids)
    prompts = Prompts(loaded.tokenizer)
    model_report: dict[str, Any] = {
        "spec": spec,
        "path": str(subject.path),
        "description": subject.description,
        "synthetic": subject.synthetic,
        "eos_biased": eos,
        "systems": {},
        "cells": [],
    }
    report["models"].append(model_report)
    runners = Runners(args, loaded, eos)
    systems = list(args.systems)
    logdir = workdir / "logs" / spec.replace(":", "_").replace("/", "_")
    logdir.mkdir(parents=True, exist_ok=True)

    for system in systems:
        model_report["systems"][system] = {"status": "pending"}
    if "vllm_mlx" in systems:
        problem = vllm_problem(args.vllm_python)
        if problem:
            log(f"[{spec}] vllm_mlx skipped: {problem}")
            model_report["systems"]["vllm_mlx"] = {"status": "skipped", "reason": problem}
            systems.remove("vllm_mlx")

    gpu = GpuSampler()
    env = server_env()
    try:
        for system in [s for s in systems if s in SERVER_SYSTEMS]:
            server = make_server(system, subject.path, logdir, args)
            model_report["systems"][system]["command"] = shlex.join(server.argv)
            runners.servers[system] = server
            if not args.start_one_by_one:
                server.start(env)
        # Start them all, then wait for each: loading overlaps. One by one: each is started once
        # the one before is ready (on an 80 GB card, an 8B model loading in three servers at
        # once beside this process's own copy ran two of them out of memory).
        for system, server in list(runners.servers.items()):
            started = time.perf_counter()
            if args.start_one_by_one:
                server.start(env)
            try:
                await wait_ready(server, args.server_start_timeout_s)
            except RuntimeError as exc:
                log(f"[{spec}] {system} skipped: {str(exc).splitlines()[0]}")
                model_report["systems"][system].update(status="skipped", reason=str(exc))
                server.stop()
                del runners.servers[system]
                systems.remove(system)
                continue
            runners.names[system] = await served_name(server)
            model_report["systems"][system]["ready_after_s"] = time.perf_counter() - started
            if args.client == "openai":
                import openai

                runners.clients[system] = openai.AsyncOpenAI(
                    base_url=server.base_url, api_key="bench", max_retries=0, timeout=600
                )
            else:
                import httpx

                runners.clients[system] = httpx.AsyncClient(
                    base_url=server.base_url,
                    timeout=600,
                    limits=httpx.Limits(max_connections=max(args.concurrency) + 4),
                )

        def shared_loader(_spec: object) -> Any:
            # The weights raw mlx-lm uses (evaluated arrays, safe across threads), in a module
            # tree of the engine's own: its compiled decode fuses projections in place.
            return dataclasses.replace(loaded, model=structural_copy(loaded.model))

        model_report["engine_weights"] = "own copy" if args.engine_own_weights else "shared"

        async with contextlib.AsyncExitStack() as stack:
            if "engine" in systems:
                runners.engine = await stack.enter_async_context(
                    trio_mlx.open_engine(
                        subject.path,
                        **SERVER_PROCESS_SETTINGS,
                        loader=load_model if args.engine_own_weights else shared_loader,
                        admission="wait",
                        max_waiting=64,
                        max_wait=600.0,
                    )
                )
            nursery = await stack.enter_async_context(trio.open_nursery())
            nursery.start_soon(gpu.run)
            try:
                await measure(spec, args, deadline, systems, runners, prompts, gpu, model_report)
                if args.decode_pairs and time.monotonic() < deadline:
                    from bench.decode_pairs import measure_pairs

                    model_report["decode_pairs"] = await measure_pairs(
                        runners,
                        prompts,
                        systems,
                        pairs=args.decode_pairs,
                        prompt_tokens=min(args.prompt_tokens),
                        max_tokens=args.max_tokens,
                    )
                    log(f"[{spec}] decode pairs: {model_report['decode_pairs']['summary']}")
            finally:
                nursery.cancel_scope.cancel()
        for system in systems:
            model_report["systems"][system]["status"] = "ran"
            if system in runners.servers:
                model_report["systems"][system]["memory_end"] = runners.servers[system].memory(gpu)
        model_report["harness_rss_peak_mb"] = (proc_status_kb(os.getpid(), "VmHWM") or 0) / 1024
        model_report["harness_gpu_peak_mb"] = gpu.peak.get(os.getpid())
    finally:
        for server in runners.servers.values():
            server.stop()
        for client in runners.clients.values():
            with contextlib.suppress(Exception):
                await client.close() if hasattr(client, "close") else None


async def measure(
    spec: str,
    args: argparse.Namespace,
    deadline: float,
    systems: list[str],
    runners: Runners,
    prompts: Prompts,
    gpu: GpuSampler,
    model_report: dict[str, Any],
) -> None:
    import mlx.core as mx
    import trio

    n = args.max_tokens
    # Warm-up: every system, every prompt length alone, and every burst size on the shortest.
    warm = [(p, 1) for p in args.prompt_tokens]
    if not args.no_warmup_bursts:  # batched kernels of each burst size (compiled on first use)
        warm += [(min(args.prompt_tokens), c) for c in args.concurrency if c > 1]
    seed = 10**6
    for system in systems:
        started = time.perf_counter()
        for p, c in warm:
            batch = [prompts.make(p, seed + i) for i in range(c)]
            seed += c
            with trio.move_on_after(args.cell_timeout_s):
                await runners.run(system, batch, min(n, args.warmup_tokens))
        model_report["systems"][system]["warmup_s"] = time.perf_counter() - started
    log(
        f"[{spec}] warm: "
        + ", ".join(f"{s} {model_report['systems'][s]['warmup_s']:.1f}s" for s in systems)
    )

    cells = [(p, c) for p in args.prompt_tokens for c in args.concurrency]
    k = 0
    for repeat in range(args.repeats):
        for p, c in cells:
            k += 1
            batch = [
                prompts.make(p, zlib.crc32(f"{spec} {repeat} {p} {c} {i}".encode()))
                for i in range(c)
            ]
            order = systems[k % len(systems) :] + systems[: k % len(systems)]
            raw_tokens: list[int] | None = None
            for system in order:
                row: dict[str, Any] = {
                    "system": system,
                    "repeat": repeat,
                    "prompt_tokens": p,
                    "prompt_tokens_actual": len(batch[0][1]),
                    "concurrency": c,
                    "max_tokens": n,
                }
                if time.monotonic() > deadline:
                    row["skipped"] = "deadline"
                    model_report["cells"].append(row)
                    continue
                if system in ("raw", "engine"):
                    mx.reset_peak_memory()
                gpu.total_peak = None
                gpu.sample()
                started = time.perf_counter()
                results: list[RequestResult] = []
                with trio.move_on_after(args.cell_timeout_s) as scope:
                    results = await runners.run(system, batch, n)
                wall = time.perf_counter() - started
                row.update(cell_figures(results, wall, n))
                if scope.cancelled_caught:
                    row["timed_out_after_s"] = args.cell_timeout_s
                if system in ("raw", "engine"):
                    row["mlx_peak_mb"] = mx.get_peak_memory() / 2**20
                if system in runners.servers:
                    row.update(runners.servers[system].memory(gpu))
                if gpu.enabled:
                    gpu.sample()
                    row["gpu_total_used_peak_mb"] = gpu.total_peak
                row["requests_detail"] = [
                    {
                        "ttft_ms": None if r.ttft_s is None else 1e3 * r.ttft_s,
                        "e2e_s": r.e2e_s,
                        "tokens": r.tokens,
                        "chunks": r.chunks,
                        "decode_tps": r.decode_tps,
                        "slowest_gaps_ms": r.slowest_gaps(),
                        "status": r.status,
                    }
                    for r in results
                ]
                first = results[0] if results else None
                if system == "raw" and first is not None:
                    raw_tokens = first.token_ids
                    row["first_text"] = runners.loaded.tokenizer.decode(first.token_ids or [])
                elif first is not None and first.text is not None:
                    row["first_text"] = first.text
                elif first is not None and first.token_ids is not None:
                    row["first_token_ids"] = first.token_ids[:n]
                model_report["cells"].append(row)
                log(short_line(spec, row))
            # Same greedy output as raw mlx-lm (ids for the engine, text for the servers).
            same = [r for r in model_report["cells"][-len(order) :]]
            raw_row = next((r for r in same if r["system"] == "raw" and "first_text" in r), None)
            for r in same:
                if raw_row is None or r is raw_row:
                    continue
                if "first_token_ids" in r and raw_tokens is not None:
                    r["same_output_as_raw"] = r.pop("first_token_ids") == raw_tokens
                elif "first_text" in r:
                    r["same_output_as_raw"] = r["first_text"] == raw_row["first_text"]


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def short_line(spec: str, row: dict[str, Any]) -> str:
    head = (
        f"[{spec}] r{row['repeat']} p{row['prompt_tokens']} c{row['concurrency']} "
        f"{row['system']:<13}"
    )
    if row.get("skipped"):
        return head + " skipped (" + row["skipped"] + ")"
    text = (
        f"{head} ttft {fmt(row['ttft_ms_p50'])} ms  decode {fmt(row['decode_tps_p50'])} tok/s  "
        f"itl {fmt(row['itl_ms_p50'], 2)}/{fmt(row['itl_ms_p99'], 2)} ms  "
        f"agg {fmt(row['aggregate_tps'])} tok/s"
    )
    if row["refused_429"] or row["errors"] or row["short"] or row.get("timed_out_after_s"):
        text += f"  429s {row['refused_429']} errors {row['errors']} short {row['short']}"
        if row.get("timed_out_after_s"):
            text += " TIMED OUT"
    return text


# ---- summary, table, plot ----------------------------------------------------------------------


def summarize(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Medians over the repeats per (system, prompt, concurrency); ratios against raw paired by
    repeat (raw's figures from the same repeat and cell)."""
    cells = [c for c in model["cells"] if not c.get("skipped")]
    raw = {
        (c["repeat"], c["prompt_tokens"], c["concurrency"]): c
        for c in cells
        if c["system"] == "raw"
    }
    keys = sorted({(c["prompt_tokens"], c["concurrency"]) for c in cells})
    rows = []
    for p, conc in keys:
        for system in SYSTEMS:
            mine = [
                c
                for c in cells
                if c["system"] == system and c["prompt_tokens"] == p and c["concurrency"] == conc
            ]
            if not mine:
                continue

            def med(key: str, rows_: list[dict[str, Any]] = mine) -> float | None:
                return median([r.get(key) for r in rows_])

            def ratio(
                key: str, rows_: list[dict[str, Any]] = mine, p: int = p, conc: int = conc
            ) -> float | None:
                values = []
                for r in rows_:
                    base = raw.get((r["repeat"], p, conc))
                    if base and base.get(key) and r.get(key):
                        values.append(r[key] / base[key])
                return median(values)

            def delta(
                key: str, rows_: list[dict[str, Any]] = mine, p: int = p, conc: int = conc
            ) -> float | None:
                values = []
                for r in rows_:
                    base = raw.get((r["repeat"], p, conc))
                    if base and base.get(key) is not None and r.get(key) is not None:
                        values.append(r[key] - base[key])
                return median(values)

            same = [r["same_output_as_raw"] for r in mine if "same_output_as_raw" in r]
            rows.append(
                {
                    "system": system,
                    "prompt_tokens": p,
                    "concurrency": conc,
                    "repeats": len(mine),
                    "ttft_ms": med("ttft_ms_p50"),
                    "ttft_delta_ms": delta("ttft_ms_p50"),
                    "decode_tps": med("decode_tps_p50"),
                    "decode_ratio": ratio("decode_tps_p50"),
                    "itl_ms_p50": med("itl_ms_p50"),
                    "itl_ms_p99": med("itl_ms_p99"),
                    "e2e_s": med("e2e_s_p50"),
                    "aggregate_tps": med("aggregate_tps"),
                    "aggregate_ratio": ratio("aggregate_tps"),
                    "refused": sum(r["refused_429"] for r in mine),
                    "errors": sum(r["errors"] for r in mine),
                    "short": sum(r["short"] for r in mine),
                    "ok": sum(r["ok"] for r in mine),
                    "requests": sum(r["requests"] for r in mine),
                    "rss_peak_mb": max((r.get("rss_peak_mb") or 0 for r in mine), default=0)
                    or None,
                    "mem_peak_mb": max(
                        (r.get("mlx_peak_mb") or r.get("gpu_peak_mb") or 0 for r in mine), default=0
                    )
                    or None,
                    "same_output": None if not same else f"{sum(same)}/{len(same)}",
                }
            )
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# {report['title']}", ""]
    lines += [f"Command: `{report['command']}`", ""]
    lines += [
        f"Date: {report['date']}. Machine: "
        + ", ".join(f"{k} {v}" for k, v in report["machine"].items() if not isinstance(v, dict)),
        "",
    ]
    lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    lines += [f"- {note}" for note in report["notes"]] + [""]
    for model in report["models"]:
        lines += [f"## {model['spec']}: {model['description']}", ""]
        for system, info in model["systems"].items():
            if info.get("status") == "skipped":
                reason = str(info.get("reason", "")).splitlines()[0][:300]
                lines.append(f"- {LABELS[system]}: **skipped**: {reason}")
            elif info.get("command"):
                lines.append(f"- {LABELS[system]}: `{info['command']}`")
        lines += [
            "",
            "| prompt | streams | system | TTFT ms | ΔTTFT vs raw ms | decode tok/s | ×raw "
            "| ITL p50 ms | ITL p99 ms | e2e s | aggregate tok/s | ×raw | 429s | errors | short "
            "| peak RSS MB | peak MLX/GPU MB | same output |",
            "|" + "---|" * 18,
        ]
        for r in summarize(model):
            lines.append(
                f"| {r['prompt_tokens']} | {r['concurrency']} | {LABELS[r['system']]} "
                f"| {fmt(r['ttft_ms'])} | {fmt(r['ttft_delta_ms'])} | {fmt(r['decode_tps'])} "
                f"| {fmt(r['decode_ratio'], 3)} | {fmt(r['itl_ms_p50'], 2)} "
                f"| {fmt(r['itl_ms_p99'], 2)} | {fmt(r['e2e_s'], 2)} "
                f"| {fmt(r['aggregate_tps'])} | {fmt(r['aggregate_ratio'], 3)} | {r['refused']} "
                f"| {r['errors']} | {r['short']} | {fmt(r['rss_peak_mb'], 0)} "
                f"| {fmt(r['mem_peak_mb'], 0)} | {r['same_output'] or '–'} |"
            )
        kinds: dict[str, set[str]] = {}
        for cell in model["cells"]:
            for kind in cell.get("error_kinds") or []:
                kinds.setdefault(cell["system"], set()).add(kind[:160])
        for system, found in kinds.items():
            lines.append(f"- errors of {LABELS[system]}: " + "; ".join(sorted(found)[:3]))
        skipped = sum(1 for c in model["cells"] if c.get("skipped"))
        if skipped:
            lines.append(f"- {skipped} cells not run: the --deadline-s passed")
        lines.append("")
        if model.get("decode_pairs"):
            from bench.decode_pairs import markdown

            lines += markdown(model["decode_pairs"], LABELS)
    return "\n".join(lines)


def render_png(report: dict[str, Any], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_bare_png(report, out)
        return "matplotlib unavailable: bars only, no labels (redraw with --render)"
    models = report["models"]
    if not models:
        return "nothing to plot"
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.2 * len(models)), squeeze=False)
    colours = dict(
        zip(SYSTEMS, ("#555555", "#1f77b4", "#2ca02c", "#ff7f0e", "#d62728"), strict=True)
    )
    for row, model in zip(axes, models, strict=True):
        summary = summarize(model)
        prompts = sorted({r["prompt_tokens"] for r in summary})
        present = [s for s in SYSTEMS if any(r["system"] == s for r in summary)]
        ax = row[0]
        width = 0.8 / max(1, len(present))
        for i, system in enumerate(present):
            values = [single_stream_decode(summary, system, p) for p in prompts]
            xs = [j + i * width for j in range(len(prompts))]
            ax.bar(xs, values, width, label=LABELS[system], color=colours[system])
        ax.set_xticks([j + width * (len(present) - 1) / 2 for j in range(len(prompts))])
        ax.set_xticklabels([f"prompt {p}" for p in prompts])
        ax.set_ylabel("decode tok/s, one stream (median)")
        ax.set_title(f"{model['spec']}: single-stream decode")
        ax.legend(fontsize=8)
        ax = row[1]
        p0 = min(prompts) if prompts else 0
        for system in present:
            pts = sorted(
                (r["concurrency"], r["aggregate_tps"] or 0)
                for r in summary
                if r["system"] == system and r["prompt_tokens"] == p0
            )
            if pts:
                ax.plot(
                    [c for c, _ in pts],
                    [v for _, v in pts],
                    "o-",
                    label=LABELS[system],
                    color=colours[system],
                )
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in summary})
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("aggregate tok/s (median)")
        ax.set_title(f"{model['spec']}: aggregate, prompt {p0}")
        ax.legend(fontsize=8)
    fig.suptitle(report["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return "matplotlib"


def single_stream_decode(summary: list[dict[str, Any]], system: str, prompt: int) -> float:
    """The median single-stream decode tok/s of `system` at `prompt` tokens (0 when absent)."""
    return next(
        (
            r["decode_tps"] or 0
            for r in summary
            if r["system"] == system and r["prompt_tokens"] == prompt and r["concurrency"] == 1
        ),
        0,
    )


def write_bare_png(report: dict[str, Any], out: Path) -> None:
    """A label-less bar chart (single-stream decode tok/s, systems in SYSTEMS order, one group per
    model and prompt length) written with zlib alone."""
    import struct
    import zlib

    groups = []
    for model in report["models"]:
        summary = summarize(model)
        for p in sorted({r["prompt_tokens"] for r in summary}):
            groups.append([single_stream_decode(summary, s, p) for s in SYSTEMS])
    colours = [(85, 85, 85), (31, 119, 180), (44, 160, 44), (255, 127, 14), (214, 39, 40)]
    w, h = 40 + 130 * max(1, len(groups)), 300
    top = max([v for g in groups for v in g] + [1])
    pixels = [[(255, 255, 255)] * w for _ in range(h)]
    for gi, group in enumerate(groups):
        for si, value in enumerate(group):
            bar = int(250 * value / top)
            x0 = 20 + gi * 130 + si * 22
            for y in range(h - 20 - bar, h - 20):
                for x in range(x0, x0 + 18):
                    pixels[y][x] = colours[si]
    raw = b"".join(b"\x00" + bytes(c for px in line for c in px) for line in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + tag
            + data
            + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        )

    out.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    report["summary"] = {m["spec"]: summarize(m) for m in report["models"]}
    report["plot"] = render_png(report, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    md = render_markdown(report)
    md += f"\n![plot]({out.with_suffix('.png').name})\n"
    out.with_suffix(".md").write_text(md)


async def main(args: argparse.Namespace) -> None:
    started = time.monotonic()
    deadline = started + args.deadline_s
    report: dict[str, Any] = {
        "title": f"trio-mlx vs raw mlx-lm and peer servers: {', '.join(args.model)}",
        "command": args.command_line,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "versions": versions(args),
        "settings": {k: v for k, v in vars(args).items() if k != "command_line"},
        "notes": [
            "Greedy decoding; EOS token(s) get logit_bias -100 on every system (raw mlx-lm: "
            "generate_step with a sampler argmax(logprobs + dense bias); engine and servers: the "
            "request's logit_bias), so every request generates max_tokens tokens; `short` counts "
            "those that did not. `same output`: the first request of a cell gave the same greedy "
            "tokens (engine) or text (servers) as raw mlx-lm.",
            "HTTP systems: streaming /v1/chat/completions read by the "
            + ("`openai` AsyncOpenAI client" if args.client == "openai" else "httpx SSE reader")
            + " in the harness process (max_retries=0).",
            "Each request: its own random prompt (a short system message with a number of its "
            "own, then SmolLM2-vocabulary words as the user message, chat template applied), "
            "shared by all systems within a cell, never reused: no prefix-cache hits beyond the "
            "template's first tokens. `prompt` is the target length; the actual length is in "
            "the JSON.",
            "raw mlx-lm runs bursts one request after the other (no batching); TTFT and e2e of "
            "every system are counted from the start of the burst, so they include queueing.",
            "trio-mlx HTTP server started with --admission wait --max-waiting 64 --max-wait 600 "
            "(the engine API likewise): concurrent requests queue, 429s are counted.",
            "decode tok/s = (tokens - 1) / (last token - first token), per request, median. "
            "ITL over every gap between content chunks. aggregate = all tokens / burst wall time.",
            "Ratios (×raw, ΔTTFT) are against raw mlx-lm in the same repeat and cell, median over "
            "repeats. Peak RSS: the server process's VmHWM. Peak MLX/GPU: mx.get_peak_memory() "
            "per cell for raw and engine (same process, shared weights), nvidia-smi per-process "
            "memory sampled each second for servers on a GPU host (gpu_total_used_peak_mb in the "
            "JSON: the whole GPU, all processes, per cell).",
        ],
        "models": [],
    }
    out = Path(args.out)
    try:
        for spec in args.model:
            await run_model(spec, args, deadline, report)
    finally:
        report["elapsed_s"] = time.monotonic() - started
        write_outputs(report, out)
        log(f"wrote {out.with_suffix('.json')}, .md, .png in {report['elapsed_s']:.0f} s")
        for model in report["models"]:
            print_ratios(model)


def print_ratios(model: dict[str, Any]) -> None:
    for r in summarize(model):
        if r["system"] == "raw":
            continue
        log(
            f"  {model['spec']} p{r['prompt_tokens']} c{r['concurrency']} "
            f"{LABELS[r['system']]:<16} decode ×{fmt(r['decode_ratio'], 3)}  "
            f"aggregate ×{fmt(r['aggregate_ratio'], 3)}  ΔTTFT {fmt(r['ttft_delta_ms'])} ms"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(t) for t in text.split(",") if t]

    parser = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="tiny",
        type=lambda s: s.split(","),
        help="tiny | smollm2 | synthetic:<shape>-<bf16|q4> | a dir; comma-separated",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), type=lambda s: [x for x in s.split(",") if x]
    )
    parser.add_argument("--prompt-tokens", type=ints, default=[128, 2048])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=ints, default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument(
        "--engine-own-weights",
        action="store_true",
        help="the engine loads its own copy of the model (default: raw mlx-lm's weights)",
    )
    parser.add_argument(
        "--no-warmup-bursts", action="store_true", help="warm up with single requests only"
    )
    parser.add_argument("--client", choices=("openai", "httpx"), default="openai")
    parser.add_argument("--out", default="docs/benchmarks/compare")
    parser.add_argument("--workdir", default="/tmp/trio-mlx-compare")
    parser.add_argument(
        "--vllm-python",
        default="/tmp/venv-vllm-mlx/bin/python",
        help="the venv python with vllm-mlx; none: not installed here",
    )
    parser.add_argument("--http-args", default="", help="extra arguments for trio-mlx serve")
    parser.add_argument("--mlx-lm-server-args", dest="mlx_lm_server_args", default="")
    parser.add_argument("--vllm-mlx-args", dest="vllm_mlx_args", default="")
    parser.add_argument(
        "--deadline-s", type=float, default=3600, help="no new cell starts after this many seconds"
    )
    parser.add_argument("--cell-timeout-s", type=float, default=600)
    parser.add_argument("--server-start-timeout-s", type=float, default=600)
    parser.add_argument(
        "--start-one-by-one",
        action="store_true",
        help="start each server once the one before is ready (loads do not overlap: less memory)",
    )
    parser.add_argument(
        "--decode-pairs",
        type=int,
        default=0,
        metavar="N",
        help="after the grid, N back-to-back (raw, system) single-stream pairs per system on the "
        "shortest prompt: decode ratio within each pair (bench/decode_pairs.py)",
    )
    parser.add_argument("--render", metavar="JSON", help="only redraw .md and .png from a JSON")
    args = parser.parse_args(argv)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if "raw" not in args.systems:
        args.systems.insert(0, "raw")  # the baseline of every ratio
    args.command_line = "python -m bench.compare " + shlex.join(argv)
    return args


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    if arguments.render:
        path = Path(arguments.render)
        saved = json.loads(path.read_text())
        write_outputs(saved, path.with_suffix(""))
        log(f"redrew {path.with_suffix('.md')} and .png")
        sys.exit(0)
    import trio

    trio.run(main, arguments)
