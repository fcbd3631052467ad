"""The command line, run as a user runs it: a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio_mlx


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_mlx", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_generate_streams_the_greedy_completion(tiny_model_dir: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_dir) as engine:
        expected = await engine.generate("Once upon", max_tokens=8, temperature=0.0)
    done = run_cli(
        "generate",
        "Once upon",
        "--model",
        str(tiny_model_dir),
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "-v",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.text + "\n"
    assert "8 completion tokens, finish_reason=length" in done.stderr


def test_a_missing_model_is_a_clear_error_and_exit_code_1() -> None:
    done = run_cli("generate", "hi", "--model", "/no/such/model")
    assert done.returncode == 1
    assert "trio-mlx: error:" in done.stderr and "/no/such/model" in done.stderr
    assert "Traceback" not in done.stderr


def test_convert_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    done = run_cli("convert", str(bogus), str(tmp_path / "out"))
    assert done.returncode == 1
    assert str(bogus) in done.stderr and "Traceback" not in done.stderr
