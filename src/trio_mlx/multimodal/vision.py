"""The vision half of a multimodal prefill: pixel values -> input embeddings. Runner thread only.

`VisionFeatureCache` keeps the vision tower's output for the media of recent requests, keyed by a
hash of the processed pixels (`VisionInputs.media_key`), LRU, bounded in entries and bytes: the
second turn of a conversation about an image, a retry, or the same image sent again does not
encode it again. Features are cached where the model can take them back
(`get_input_embeddings(..., cached_image_features=)`, as mlx-vlm's own cache does) and mlx-vlm
gives a way to compute them alone (`encode_images`, `encode_image`, or a Qwen-style
`vision_tower(pixels, grid)`) or they can be caught on their way into the embeddings (the LLaVA
family's `_merge_input_ids_with_image_features`); other models encode every time.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from trio_mlx.bounded_map import BoundedMap
from trio_mlx.multimodal.loading import VisionLanguageModel
from trio_mlx.multimodal.prepare import VisionInputs


@dataclass
class VisionCacheCounters:
    hits: int = 0
    misses: int = 0
    encoded: int = 0  # vision tower runs (cached or not)


class VisionFeatureCache:
    """LRU of vision features by media hash, at most `max_entries` and `max_bytes` (a
    `BoundedMap` touched on every hit); features larger than `max_bytes` are not kept."""

    def __init__(self, max_entries: int = 32, max_bytes: int = 512 * 1024 * 1024) -> None:
        self._entries: BoundedMap[str, Any] = BoundedMap(max_entries, max_bytes)
        self.counters = VisionCacheCounters()

    def get(self, key: str) -> Any:
        features = self._entries.get(key)
        if features is None:
            self.counters.misses += 1
            return None
        self._entries.touch(key)
        self.counters.hits += 1
        return features

    def put(self, key: str, features: Any) -> None:
        self._entries.put(key, features, _nbytes(features))

    def clear(self) -> None:
        self._entries.clear()

    def statistics(self) -> dict[str, int]:
        c = self.counters
        return {
            "entries": len(self._entries),
            "bytes": self._entries.bytes,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": self._entries.evicted,
            "encoded": c.encoded,
        }


def _nbytes(features: Any) -> int:
    if isinstance(features, list | tuple):
        return sum(_nbytes(f) for f in features)
    return int(getattr(features, "nbytes", 0))


@dataclass(frozen=True)
class PromptEmbeddings:
    """A multimodal prompt ready for the language model: the merged input embeddings
    `(1, L, hidden)`, the position ids the model computed for the whole prompt (mrope models:
    `(3, 1, L)`; else None) and the rope delta that places generated tokens after them."""

    embeds: Any
    position_ids: Any
    rope_deltas: Any


#: per model class: whether its `get_input_embeddings` takes `cached_image_features`
_TAKES_CACHED: dict[type, bool] = {}


def _takes_cached_features(model: Any) -> bool:
    """Whether the model's `get_input_embeddings` takes `cached_image_features`, read from its
    source once per class (`inspect.getsource` tokenizes the method: ~1 ms a request)."""
    cls = type(model)
    known = _TAKES_CACHED.get(cls)
    if known is None:
        try:
            source = inspect.getsource(cls.get_input_embeddings)
        except (OSError, TypeError, AttributeError):
            source = ""
        known = _TAKES_CACHED[cls] = "cached_image_features" in source
    return known


def _compute_features(model: Any, pixels: Any, extras: dict[str, Any]) -> Any:
    if hasattr(model, "encode_images"):
        return model.encode_images(pixels, **extras)
    if hasattr(model, "encode_image"):
        return model.encode_image(pixels)
    tower = getattr(model, "vision_tower", None)
    grid = extras.get("image_grid_thw")
    if grid is None:
        grid = extras.get("video_grid_thw")
    if tower is not None and grid is not None:
        dtype = tower.patch_embed.proj.weight.dtype
        features = tower(pixels.astype(dtype), grid, output_hidden_states=False)
        # Qwen3-VL / Qwen3.5 towers return (features, deepstack features); their
        # `get_input_embeddings(cached_image_features=)` takes the features alone.
        return features[0] if isinstance(features, tuple) else features
    return None


#: the method LLaVA-style models merge their projected image features through (mlx-vlm), whose
#: first argument is what `get_input_embeddings(cached_image_features=)` takes back
_MERGE = "_merge_input_ids_with_image_features"


def _capture_merged_features(model: Any) -> list[Any]:
    """Where a model has no call that computes its image features alone but merges them through
    `_MERGE` (mlx-vlm's LLaVA family): a list that receives the features the next
    `get_input_embeddings` merges (an instance attribute over the method, removed by
    `_release_merged_features`); they are cached only where they give the same embeddings back
    (`_gives_back`). Elsewhere an empty list that stays so."""
    merge = getattr(model, _MERGE, None)
    captured: list[Any] = []
    if merge is None or not callable(merge):
        return captured

    def capture(image_features: Any, *args: Any, **kwargs: Any) -> Any:
        captured.append(image_features)
        return merge(image_features, *args, **kwargs)

    object.__setattr__(model, _MERGE, capture)
    return captured


def _release_merged_features(model: Any) -> None:
    vars(model).pop(_MERGE, None)


def _gives_back(
    model: Any, input_ids: Any, pixels: Any, extras: dict[str, Any], features: Any, result: Any
) -> bool:
    """Whether `features`, caught on their way into `result`'s embeddings, give the same
    embeddings back as `cached_image_features` (a model may take back something else, e.g. the
    tower's output before its projector): a merge without the tower, cheap."""
    again = model.get_input_embeddings(
        input_ids, pixels, **extras, cached_image_features=features
    ).inputs_embeds
    same = mx.array_equal(again, result.inputs_embeds)
    mx.eval(features, same)
    return bool(same.item())


def embed_prompt(
    vlm: VisionLanguageModel,
    prompt_tokens: tuple[int, ...],
    vision: VisionInputs,
    cache: VisionFeatureCache,
) -> PromptEmbeddings:
    """Run (or reuse) the vision tower and merge its features into the prompt's embeddings."""
    model = vlm.model
    extras = {k: mx.array(v) for k, v in vision.arrays.items() if v is not None}
    pixels = extras.pop("pixel_values", None)
    if pixels is None:
        pixels = extras.pop("pixel_values_videos", None)
        if pixels is not None:
            extras["pixel_values_videos"] = pixels
    input_ids = mx.array([list(prompt_tokens)], dtype=mx.int32)
    captured: list[Any] = []
    if pixels is not None and _takes_cached_features(model):
        features = cache.get(vision.media_key)
        if features is None:
            features = _compute_features(model, pixels, extras)
            if features is not None:
                mx.eval(features)
                cache.counters.encoded += 1
                cache.put(vision.media_key, features)
        if features is not None:
            extras["cached_image_features"] = features
        else:  # no call computes them alone: caught on their way into the embeddings
            cache.counters.encoded += 1
            captured = _capture_merged_features(model)
    else:
        cache.counters.encoded += 1
    try:
        result = model.get_input_embeddings(input_ids, pixels, **extras)
    finally:
        _release_merged_features(model)
    if len(captured) == 1 and _gives_back(model, input_ids, pixels, extras, captured[0], result):
        cache.put(vision.media_key, captured[0])
    embeds = result.inputs_embeds
    position_ids = getattr(result, "position_ids", None)
    rope_deltas = getattr(result, "rope_deltas", None)
    mx.eval([a for a in (embeds, position_ids, rope_deltas) if a is not None])
    return PromptEmbeddings(embeds, position_ids, rope_deltas)
