"""Loading vision-language models through mlx-vlm. Runs on the runner thread only.

A model directory is a vision-language model when its `config.json` has a `vision_config` and a
`model_type` that mlx-vlm has a model for (`is_vision_model_dir`), or when the caller forces it
(`--mllm`, `EngineConfig.force_mllm`, vllm-mlx's `force_mllm`). Everything else keeps the text
path (`engine.loading`).

The loaded model serves two kinds of request with one set of weights:
- text-only requests go through `TextView`, the VLM's language model behind the interface the
  text path expects (`model(tokens, cache=...) -> logits`, `layers`, `make_cache`): the same
  route, prefix cache and speed as a text model;
- requests with images or video go through `multimodal.job` (vision encoding, then prefill with
  the merged input embeddings), on the same language model and the same kind of KV cache.
On an MRoPE language model (the Qwen-VL family) text positions, which are every text request's
and every generated token's, take MLX's fused rope (`text_rope`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trio_mlx.engine.model_spec import ResolvedModel
from trio_mlx.errors import ModelLoadError
from trio_mlx.multimodal import text_rope
from trio_mlx.multimodal.text_rope import TextRoPE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionProcessing:
    """What request preparation needs of a vision-language model: plain Python/numpy, usable
    from a worker thread (`ModelInfo.multimodal`). `processor` is the Hugging Face-style
    processor mlx-vlm loads (chat template, image and video processors, tokenizer)."""

    processor: Any
    model_type: str
    image_token_id: int | None
    video_token_id: int | None

    @property
    def supports_video(self) -> bool:
        return self.video_token_id is not None and _video_processor(self.processor) is not None


@dataclass(frozen=True)
class VisionLanguageModel:
    """The multimodal half of a loaded model (`LoadedModel.multimodal`): mlx-vlm's `Model`
    (vision tower + language model; MLX arrays, runner thread only) and its `processing`."""

    model: Any
    processing: VisionProcessing
    #: the language model's text positions through the fused rope (`text_rope`; None: the
    #: model keeps mlx-vlm's rotary embedding for every position)
    text_rope: TextRoPE | None = None

    @property
    def language_model(self) -> Any:
        return self.model.language_model


def _video_processor(processor: Any) -> Any:
    return getattr(processor, "video_processor", None) or getattr(
        processor, "image_processor", None
    )


def _model_type(config: dict[str, Any]) -> str | None:
    value = config.get("model_type")
    return value if isinstance(value, str) and value else None


def mlx_vlm_knows(model_type: str) -> bool:
    """Whether mlx-vlm has a model package for `model_type` (without importing it)."""
    try:
        from mlx_vlm.utils import MODEL_REMAPPING
    except ImportError:
        return False
    name = MODEL_REMAPPING.get(model_type, model_type).replace("-", "_")
    try:
        return importlib.util.find_spec(f"mlx_vlm.models.{name}") is not None
    except (ImportError, ValueError):
        return False


def is_vision_model_dir(path: Path) -> bool:
    """A directory whose config names a vision tower and a model type mlx-vlm serves."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or not config.get("vision_config"):
        return False
    model_type = _model_type(config)
    return model_type is not None and mlx_vlm_knows(model_type)


class TextView:
    """A VLM's language model as the text path drives it: `view(tokens, cache=c)` returns the
    logits array (mlx-vlm's language models return an output object), and positions always
    follow the cache offset.

    mlx-vlm's mrope language models (the Qwen-VL family) keep the last request's position state
    (`_position_ids`, `_rope_deltas`) on the module; a text request would inherit an image
    request's. Each call here clears the prompt positions and passes a zero rope delta, which
    makes the model place tokens at `cache offset + i`: what a text model does; with `text_rope`
    those positions take the fused rope (`text_rope`).
    """

    def __init__(self, language_model: Any, text_rope: TextRoPE | None = None) -> None:
        import mlx.core as mx

        self.language_model = language_model
        self._text_rope = text_rope
        self._mrope = hasattr(language_model, "_rope_deltas")
        self._zero = mx.zeros((1, 1), dtype=mx.int32)
        # evaluated here: a lazy array made on the loading thread's stream cannot be evaluated
        # on the runner's thread (MLX: "There is no Stream(cpu, 0) in current thread")
        mx.eval(self._zero)

    @property
    def layers(self) -> Any:
        return self.language_model.layers

    @property
    def places_rows(self) -> bool:
        """Whether a call may shift rows' positions (`row_deltas`): the fused rope is in."""
        return self._text_rope is not None

    def modules(self) -> list[Any]:
        """The language model's modules (what the start-up options walk: fused projections'
        default, quantized rows)."""
        return list(self.language_model.modules())

    def named_modules(self) -> list[tuple[str, Any]]:
        return list(self.language_model.named_modules())

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.language_model)

    def __call__(
        self, tokens: Any, cache: Any = None, row_deltas: Any = None, **kwargs: Any
    ) -> Any:
        """The logits of `tokens` at their text positions; `row_deltas` (an int32 array, one a
        row) shifts each row's positions (rows continuing prompts with media: their rope
        deltas), through the fused rope (`text_rope`: a model without it has no such rows)."""
        lm = self.language_model
        if self._mrope:
            lm._position_ids = None
            kwargs.setdefault("rope_deltas", self._zero)
        if self._text_rope is None:
            if row_deltas is not None:
                raise ValueError("this model cannot place rows at positions of their own")
            return logits_of(lm(tokens, cache=cache, **kwargs))
        with self._text_rope.text_positions(row_deltas):
            return logits_of(lm(tokens, cache=cache, **kwargs))


def logits_of(output: Any) -> Any:
    """The logits array of a language model's output (mlx-vlm wraps it; mlx-lm does not)."""
    return getattr(output, "logits", output)


def load_vision_model(
    resolved: ResolvedModel,
) -> tuple[Any, Any, dict[str, Any], VisionLanguageModel]:
    """Load `resolved` with mlx-vlm. Returns (text view, tokenizer, config, multimodal half).

    The tokenizer is mlx-lm's `TokenizerWrapper` over the directory's tokenizer (what the text
    path's preparation, detokenizer and stop handling use). Raises `ModelLoadError` naming the
    directory and the reason.
    """
    try:
        config = json.loads((resolved.path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{resolved.path}/config.json: {exc}") from exc
    model_type = _model_type(config)
    if model_type is None or not mlx_vlm_knows(model_type):
        raise ModelLoadError(
            f"{resolved.path}: mlx-vlm has no model for model_type {model_type!r} "
            "(is mlx-vlm installed?)"
        )
    try:
        from mlx_lm.utils import load_tokenizer
        from mlx_vlm.utils import load as vlm_load

        model, processor = vlm_load(str(resolved.path))
        eos = config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else None
        tokenizer = load_tokenizer(resolved.path, eos_token_ids=eos_ids)  # type: ignore[no-untyped-call]
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{resolved.path}: cannot load the vision model: {exc}") from exc
    processing = VisionProcessing(
        processor=processor,
        model_type=model_type,
        image_token_id=_token_id(model.config, "image_token_id", "image_token_index"),
        video_token_id=_token_id(model.config, "video_token_id", "video_token_index"),
    )
    vision = VisionLanguageModel(
        model=model, processing=processing, text_rope=text_rope.install(model.language_model)
    )
    log.info("loaded %s as a vision-language model (mlx-vlm %s)", resolved.name, model_type)
    return TextView(model.language_model, vision.text_rope), tokenizer, config, vision


def _token_id(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
