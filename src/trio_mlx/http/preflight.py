"""Checks `trio-mlx serve` makes before it starts, each failure one line naming cause and fix.

`StartupError.exit_code` is 2 for a usage error (an argument that cannot work: a host that does
not resolve or is not this machine's, a port out of range) and 1 for everything else (a port in
use, permission denied, a missing or unreadable model, not enough memory). The checks are cheap
and run before the listener is bound; `bind_error` turns the same failures, met later when the
listener is really bound (another process took the port in between), into the same lines.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from trio_mlx.errors import TrioMLXError

USAGE = 2
FAILURE = 1


class StartupError(TrioMLXError):
    """The server cannot start; the message says why and what to do."""

    code = "startup_error"

    def __init__(self, message: str, *, exit_code: int = FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_listen(host: str, port: int) -> None:
    """Raise `StartupError` unless a listener can be bound at `host:port` (then released)."""
    if not 0 <= port <= 65535:
        raise StartupError(f"--port {port} is not a port number (0-65535)", exit_code=USAGE)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise StartupError(
            f"--host {host}: no such address or host name ({exc}); use an address of this "
            "machine: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)",
            exit_code=USAGE,
        ) from None
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise bind_error(host, port, exc) from None


def bind_error(host: str, port: int, exc: BaseException) -> StartupError:
    """The one-line `StartupError` for a failure to listen at `host:port`."""
    os_error = first_os_error(exc)
    code = os_error.errno if os_error is not None else None
    where = f"{host}:{port}"
    if code == errno.EADDRINUSE:
        return StartupError(
            f"port {port} is already in use on {host} (another server is listening there); "
            f"stop it, or pick a free port with --port (e.g. --port {port + 1 if port else 8001})"
        )
    if code == errno.EACCES:
        return StartupError(
            f"permission denied to listen on {where}: ports below 1024 need root or "
            "CAP_NET_BIND_SERVICE; use a port above 1023, e.g. --port 8000"
        )
    if code == errno.EADDRNOTAVAIL:
        return StartupError(
            f"--host {host} is not an address of this machine; use 127.0.0.1 (this machine "
            "only), 0.0.0.0 (every interface) or one of its own addresses",
            exit_code=USAGE,
        )
    reason = os_error.strerror if os_error is not None and os_error.strerror else str(exc)
    return StartupError(f"cannot listen on {where}: {reason}")


def first_os_error(exc: BaseException) -> OSError | None:
    """The `OSError` in `exc`, its group or its causes, or None."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_os_error(inner)
            if found is not None:
                return found
    for linked in (exc.__cause__, exc.__context__):
        if linked is not None and linked is not exc:
            found = first_os_error(linked)
            if found is not None:
                return found
    return None


def check_model(spec: str | Path | None) -> None:
    """Raise `StartupError` for a model path that is missing, unreadable, or larger than memory.

    A repo id (`org/name`, not a path on disk) and the bundled default are left to the loader.
    """
    if spec is None:
        return
    path = Path(spec).expanduser()
    if not path.exists():
        if isinstance(spec, str) and spec.count("/") == 1 and not spec.startswith((".", "/")):
            return  # a Hugging Face repo id, looked up in the local cache by the loader
        raise StartupError(
            f"{spec}: no such model directory or GGUF file; pass an mlx-lm directory, a .gguf "
            "file, a Hugging Face repo id in the local cache, or nothing for the bundled model"
        )
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise StartupError(
            f"{path}: permission denied reading the model; make it readable (chmod a+rX) "
            "or run trio-mlx as its owner"
        )
    unreadable = [p for p in _model_files(path) if not os.access(p, os.R_OK)]
    if unreadable:
        raise StartupError(
            f"{unreadable[0]}: permission denied reading the model; make it readable "
            f"(chmod a+r) or run trio-mlx as its owner"
        )
    check_memory(sum(p.stat().st_size for p in _model_files(path) if p.is_file()), path)


def check_memory(weight_bytes: int, what: Path, available: int | None = None) -> None:
    """Raise `StartupError` when `weight_bytes` exceed the memory available now."""
    available = available_memory() if available is None else available
    if available is not None and weight_bytes > available:
        raise StartupError(
            f"not enough memory for {what}: its weights take {weight_bytes / 2**30:.1f} GiB and "
            f"{available / 2**30:.1f} GiB is available; close other programs or use a smaller "
            "or quantized model"
        )


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _model_files(path: Path) -> list[Path]:
    if path.is_dir():
        return [path, *sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))]
    return [path]
