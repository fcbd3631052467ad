"""What `trio-mlx serve` logs: a "loading" line, then "listening" once the model is ready, each
message once, internal details only at debug level, and JSON lines under `--log-format json`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx


def test_loading_then_ready_then_listening_each_once_and_no_internals(
    tiny_model_dir: Path,
) -> None:
    command = [sys.executable, "-m", "trio_mlx", "serve", str(tiny_model_dir), "--port", "0"]
    # transformers at its own default verbosity, which would show its sequence-length warning
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "warning"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stderr is not None
        log = []
        for line in process.stderr:
            log.append(line.rstrip("\n"))
            if "listening on " in line:
                break
        url = log[-1].split("listening on ", 1)[1]
        long_prompt = "hello " * 9000  # past the context and the tokenizer's 8,192: a 400
        with httpx.Client(base_url=url, timeout=60) as http:
            refused = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
        assert refused.status_code == 400
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
        log += rest.splitlines()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    messages = [line.split(": ", 1)[-1] for line in log]
    order = [
        next(i for i, m in enumerate(messages) if m.startswith(prefix))
        for prefix in ("loading ", "model ", "listening on ")
    ]
    assert order == sorted(order), log
    assert sum("CPU backend:" in m for m in messages) == 1, log
    assert not any("prefill plan" in m for m in messages), log
    assert not any("Token indices sequence length" in m for m in messages), log
    assert not any("Running on" in m for m in messages), log  # hypercorn's duplicate
    plain = [m for m in messages if "HTTP/1.1" not in m]  # access-log lines may repeat
    assert len(plain) == len(set(plain)), log


def test_json_log_format_writes_one_object_a_line(tiny_model_dir: Path) -> None:
    command = [sys.executable, "-m", "trio_mlx", "serve", str(tiny_model_dir), "--port", "0"]
    process = subprocess.Popen(
        [*command, "--log-format", "json"], stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stderr is not None
        entries = []
        for line in process.stderr:
            entries.append(json.loads(line))
            if entries[-1]["message"].startswith("listening on "):
                break
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
        entries += [json.loads(line) for line in rest.splitlines() if line]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    assert entries[0]["logger"].startswith("trio_mlx") and entries[0]["level"] == "info"
    assert any(e["message"].startswith("CPU backend:") for e in entries)
