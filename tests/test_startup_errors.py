"""`trio-mlx serve` that cannot start: one line naming cause and fix, the right exit status, no
traceback unless -v. Run as a user runs it: a subprocess."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trio_mlx.http.preflight import StartupError, check_memory


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_mlx", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if "trio-mlx: error" in line]


def test_a_port_in_use_names_the_port_and_the_fix(tiny_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve(str(tiny_model_dir), "--port", str(port))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    (line,) = error_lines(done)
    assert line.startswith("trio-mlx: error: ")
    assert f"port {port} is already in use" in line and "--port" in line


def test_a_host_that_is_not_this_machines_is_a_usage_error(tiny_model_dir: Path) -> None:
    # 192.0.2.1 is TEST-NET-1: never a local address, and binding it sends nothing anywhere.
    done = serve(str(tiny_model_dir), "--host", "192.0.2.1", "--port", "0")
    assert done.returncode == 2, done.stderr
    (line,) = error_lines(done)
    assert "--host 192.0.2.1 is not an address of this machine" in line and "127.0.0.1" in line
    assert "Traceback" not in done.stderr


def test_a_port_out_of_range_is_a_usage_error(tiny_model_dir: Path) -> None:
    done = serve(str(tiny_model_dir), "--port", "70000")
    assert done.returncode == 2
    assert error_lines(done) == ["trio-mlx: error: --port 70000 is not a port number (0-65535)"]


def test_a_missing_model_is_one_line_before_anything_listens(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    done = serve(str(missing), "--port", "0")
    assert done.returncode == 1
    (line,) = error_lines(done)
    assert str(missing) in line and "no such model directory or GGUF file" in line
    assert "listening" not in done.stderr and "Traceback" not in done.stderr


def test_a_model_that_fails_to_load_is_one_line_and_verbose_adds_the_traceback(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    done = serve(str(broken), "--port", "0")
    assert done.returncode == 1
    (line,) = error_lines(done)
    assert line.startswith("trio-mlx: error: ") and str(broken) in line
    assert "Traceback" not in done.stderr
    verbose = serve(str(broken), "--port", "0", "-v")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_weights_larger_than_the_available_memory_are_refused_with_the_sizes() -> None:
    with pytest.raises(StartupError) as refused:
        check_memory(3 * 2**30, Path("/models/big"), available=2**30)
    message = str(refused.value)
    assert refused.value.exit_code == 1
    assert "not enough memory for /models/big" in message
    assert "3.0 GiB" in message and "1.0 GiB is available" in message
    check_memory(2**20, Path("/models/small"), available=2**30)  # fits: no error


# hypercorn 0.18 leaves the socket of a failed bind to the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_serve_http_itself_names_a_port_taken_after_the_checks(tiny_model_dir: Path) -> None:
    # The CLI's check runs before the listener is bound; a port taken in between (or a caller
    # of serve_http, which has no check) gets the same one-line error from the real bind.
    from trio_mlx.http.server import serve_http
    from trio_mlx.http.state import ServerSettings

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=f"port {port} is already in use"):
            await serve_http(ServerSettings(model=tiny_model_dir, port=port))
    gc.collect()  # collect hypercorn's socket here, under this test's filter
