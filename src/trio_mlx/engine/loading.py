"""Load a resolved model directory into MLX. Runs on the runner thread only."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trio_mlx.engine.cpu_path import prepare_cpu_model
from trio_mlx.engine.model_spec import ResolvedModel, resolve_model_path
from trio_mlx.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: the MLX module, its tokenizer, and the facts the engine needs.

    `model` holds MLX arrays and must only be used on the thread that loaded it. The tokenizer is
    plain Python/Rust and may be used from any thread.
    """

    model: Any
    tokenizer: Any
    name: str
    path: Path
    config: dict[str, Any]
    context_length: int
    eos_token_ids: frozenset[int]
    #: the vision half (`multimodal.loading.VisionLanguageModel`) of a model loaded through
    #: mlx-vlm; None for a text model. `model` is then the VLM's language model (`TextView`).
    multimodal: Any = None


def _context_length(config: dict[str, Any], tokenizer: Any) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10_000_000:
        return value
    return 4096


def _silence_length_warning(tokenizer: Any) -> None:
    """Mark transformers' "Token indices sequence length is longer than ..." as already given.

    The engine measures every prompt against the context itself and refuses one that does not
    fit with a 400; the tokenizer's warning (it compares with `model_max_length`) would only
    mislead.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    warned = getattr(hf, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True


def load_model(
    spec: str | Path | None, *, force_mllm: bool = False, mtp: bool = False
) -> LoadedModel:
    """Resolve `spec` (see `resolve_model_path`) and load it with mlx-lm, or with mlx-vlm when it
    is a vision-language model (`multimodal.loading.is_vision_model_dir`) or `force_mllm`. With
    `mtp`, keep the checkpoint's multi-token-prediction module (`mtp.load_mtp_model`: the model
    gains `.mtp`; refused for a model without one).

    Raises `ModelLoadError` naming the directory and the reason when anything about it is wrong.
    """
    resolved: ResolvedModel = resolve_model_path(spec)
    from trio_mlx.multimodal.loading import is_vision_model_dir

    if mtp and (force_mllm or is_vision_model_dir(resolved.path)):
        raise ModelLoadError(f"{resolved.path}: --mtp is not supported for vision-language models")
    if force_mllm or is_vision_model_dir(resolved.path):
        return _load_vision(resolved)
    import mlx_lm

    try:
        if mtp:
            model, tokenizer = _load_with_mtp(resolved.path)
        else:
            result = mlx_lm.load(str(resolved.path))
            model, tokenizer = result[0], result[1]
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{resolved.path}: cannot load the model: {exc}") from exc
    model, cpu = prepare_cpu_model(model)
    if cpu is not None:
        log.info("%s", cpu.log_line())
    try:
        config = json.loads((resolved.path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{resolved.path}/config.json: {exc}") from exc
    eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
    _silence_length_warning(tokenizer)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=resolved.name,
        path=resolved.path,
        config=config,
        context_length=_context_length(config, tokenizer),
        eos_token_ids=eos,
    )
    log.info("loaded %s from %s (context %d)", loaded.name, loaded.path, loaded.context_length)
    return loaded


def _load_with_mtp(path: Path) -> tuple[Any, Any]:
    from mlx_lm.utils import load_tokenizer

    from trio_mlx.engine.mtp import load_mtp_model

    model, config = load_mtp_model(path)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer


def _load_vision(resolved: ResolvedModel) -> LoadedModel:
    from trio_mlx.multimodal.loading import load_vision_model

    model, tokenizer, config, vision = load_vision_model(resolved)
    _silence_length_warning(tokenizer)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=resolved.name,
        path=resolved.path,
        config=config,
        context_length=_context_length(config, tokenizer),
        eos_token_ids=frozenset(int(t) for t in tokenizer.eos_token_ids),
        multimodal=vision,
    )
    log.info("loaded %s from %s (context %d)", loaded.name, loaded.path, loaded.context_length)
    return loaded
