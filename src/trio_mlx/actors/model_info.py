"""What the rest of the engine may know about the loaded model: plain values, no MLX objects.
Built on the runner thread right after loading (`describe`), handed to the Trio side once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trio_mlx.engine.kv_snapshots import SnapshotSupport, cache_support
from trio_mlx.engine.loading import LoadedModel
from trio_mlx.engine.prompt_cache import chunking_exact_limit, make_cache


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the engine may know about the loaded model (no MLX objects).

    `cache_support`: whether the model's prompt cache (as built with the engine's `max_kv_size`)
    can be snapshotted; `exact_prompt_limit`: see `prompt_cache.chunking_exact_limit`;
    `weights_bytes`: memory of the model's parameters (sets the default cache budget).
    """

    name: str
    path: Path
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: Any
    config: dict[str, Any] = field(default_factory=dict)
    cache_support: SnapshotSupport | None = None
    exact_prompt_limit: int | None = None
    weights_bytes: int = 0
    #: a vision-language model's request preparation (`multimodal.loading.VisionProcessing`:
    #: its processor and media token ids); None for a text model
    multimodal: Any = None


def describe(loaded: LoadedModel, max_kv_size: int | None) -> ModelInfo:
    """The `ModelInfo` of a loaded model, its prompt cache probed as the engine will build it
    (bounded by `max_kv_size`). Runs on the runner thread (it makes MLX objects)."""
    probe = make_cache(loaded.model, max_kv_size)
    return ModelInfo(
        name=loaded.name,
        path=loaded.path,
        context_length=loaded.context_length,
        vocab_size=_vocab_size(loaded),
        eos_token_ids=loaded.eos_token_ids,
        tokenizer=loaded.tokenizer,
        config=loaded.config,
        cache_support=cache_support(probe),
        exact_prompt_limit=chunking_exact_limit(probe),
        weights_bytes=_weights_bytes(
            loaded.model if loaded.multimodal is None else loaded.multimodal.model
        ),
        multimodal=None if loaded.multimodal is None else loaded.multimodal.processing,
    )


def _weights_bytes(model: Any) -> int:
    """Bytes held by the model's parameters."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())
    return sum(int(array.nbytes) for _, array in leaves)


def _vocab_size(loaded: LoadedModel) -> int:
    config = loaded.config
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(size, int) and size > 0:
        return size
    return len(loaded.tokenizer)
