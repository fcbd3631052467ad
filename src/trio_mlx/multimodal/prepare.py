"""Stage one of a request with images or video: from messages to a `MultimodalRequest`.

1. `split_media` finds the media parts (`parts`), refusing too many of them or a video for a model
   without a video processor, each refusal naming its part;
2. the media are fetched on the Trio side (`media.fetch_media`: data URLs, http(s) under the SSRF
   guard and limits, allowed local files), concurrently, under the caller's cancel scope;
3. on the engine's preparation worker (`actors/prepare_queue`, in turn with text requests):
   decoding (Pillow; OpenCV for video), the processor's chat template with its image
   placeholders, and the processor itself (resizing, patches, the image tokens expanded to as
   many as the image has features), then the same validation and context check as a text request
   (`RequestPreparer`).

Nothing here touches MLX or the runner: the processor's outputs travel as numpy arrays
(`VisionInputs`) and become MLX arrays on the runner thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from trio_mlx.errors import InvalidRequest
from trio_mlx.multimodal.loading import VisionProcessing
from trio_mlx.multimodal.media import (
    MediaPolicy,
    decode_image,
    decode_video,
    fetch_media,
    media_error,
)
from trio_mlx.multimodal.parts import MediaRef, add_media, split_media
from trio_mlx.preparation import ChatArgs, PreparedRequest, RequestPreparer

if TYPE_CHECKING:
    from trio_mlx.actors.prepare_queue import PreparationQueue

#: Cache-key ids for media positions start here, far above any vocabulary.
MEDIA_KEY_BASE = 1 << 40


@dataclass(frozen=True)
class VisionInputs:
    """What the processor made of a request's media, as numpy arrays (`arrays`: pixel values,
    grids, whatever the model's `get_input_embeddings` takes besides the ids), and
    `media_key`, a hash of all of it (the vision cache's key). `images` / `videos`: how many."""

    arrays: Mapping[str, Any] = field(compare=False)
    media_key: str
    images: int
    videos: int


@dataclass(frozen=True)
class MultimodalRequest(PreparedRequest):
    """A `PreparedRequest` whose prompt holds media. `prompt_tokens` are the processor's ids
    (each image placeholder expanded to its feature count: usage counts them). `cache_key`:
    the prompt with every media position replaced by an id derived from a hash of that medium
    (>= `MEDIA_KEY_BASE`), so the prefix cache matches a prompt only with the same images."""

    vision: VisionInputs | None = None
    cache_key: tuple[int, ...] = ()


async def load_media(refs: Sequence[MediaRef], policy: MediaPolicy) -> list[Any]:
    """Every medium's bytes (or a PIL image the engine API was given), fetched concurrently."""
    results: list[Any] = [None] * len(refs)

    async def one(index: int, ref: MediaRef) -> None:
        source = ref.source
        if isinstance(source, bytes | bytearray):
            results[index] = bytes(source)
        elif isinstance(source, str):
            ref_policy = policy.as_trusted() if ref.trusted else policy
            results[index] = await fetch_media(source, ref.param, ref_policy)
        elif ref.trusted and hasattr(source, "convert"):  # a PIL image from the engine API
            results[index] = source
        else:
            raise InvalidRequest("a media part needs a URL string", param=ref.param)

    if len(refs) == 1:
        await one(0, refs[0])
        return results
    async with trio.open_nursery() as nursery:
        for index, ref in enumerate(refs):
            nursery.start_soon(one, index, ref)
    return results


def check_media(refs: Sequence[MediaRef], vlm: VisionProcessing, policy: MediaPolicy) -> None:
    """Refusals that need no I/O: too many media, video on a model without video."""
    if len(refs) > policy.max_images:
        raise media_error(
            refs[policy.max_images].param,
            f"at most {policy.max_images} images and videos in one request",
            code="too_many_media",
        )
    for ref in refs:
        if ref.kind == "video" and not vlm.supports_video:
            raise media_error(ref.param, "this model does not take video")
        if ref.kind == "image" and vlm.image_token_id is None:
            raise media_error(ref.param, "this model does not take images")


def _numpy(value: Any) -> Any:
    """A processor's output as numpy: an MLX array (mlx-vlm's processors return them) as a view
    of its own memory, not a copy (the runner copies it into MLX once: `vision.embed_prompt`)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # an MLX array from the processor
        try:
            return np.asarray(memoryview(value))
        except (TypeError, ValueError, BufferError):  # no buffer numpy reads (bfloat16)
            return np.array(value)
    return value


def _update(digest: Any, name: str, value: Any) -> None:
    digest.update(name.encode())
    if isinstance(value, np.ndarray):
        digest.update(str((value.shape, value.dtype.str)).encode())
        contiguous = np.ascontiguousarray(value)
        try:
            digest.update(contiguous.data.cast("B"))  # no copy of the bytes
        except (TypeError, ValueError):  # a dtype without a buffer format
            digest.update(contiguous.tobytes())
    else:
        digest.update(repr(value).encode())


def _hash_arrays(arrays: Mapping[str, Any]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        _update(digest, name, arrays[name])
    return digest.hexdigest()


#: the processors' pixel arrays whose rows are split among the media by a grid of (t, h, w) rows
#: (Qwen-style), with that grid's name
_GRIDDED = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def media_hashes(arrays: Mapping[str, Any]) -> tuple[str, list[int]]:
    """The request's media key (a hash of all of `arrays`: the vision cache's key) and an id for
    each medium in prompt order (a hash of its pixels and its grid row, where a Qwen-style grid
    splits the pixels; otherwise one id, the media key's, for all of them). Each array's bytes
    are read once: the media key hashes the per-medium hashes of the split pixel arrays."""
    per_medium: list[str] = []
    covered: dict[str, list[str]] = {}
    for pixels_name, grid_name in _GRIDDED:
        pixels, grid = arrays.get(pixels_name), arrays.get(grid_name)
        if isinstance(pixels, np.ndarray) and isinstance(grid, np.ndarray) and grid.ndim == 2:
            parts: list[str] = []
            start = 0
            for row in grid:
                rows = int(np.prod(row))
                parts.append(_hash_arrays({"pixels": pixels[start : start + rows], "grid": row}))
                start += rows
            if start != len(pixels):  # rows the grid does not name: hashed whole below
                continue
            covered[pixels_name] = parts
            per_medium += parts
    digest = hashlib.sha256()
    for name in sorted(arrays):
        if name in covered:
            digest.update(name.encode())
            digest.update(str(arrays[name].shape).encode())
            digest.update("".join(covered[name]).encode())
        else:
            _update(digest, name, arrays[name])
    key = digest.hexdigest()
    return key, [int(h[:12], 16) for h in per_medium or [key]]


def _media_cache_key(
    tokens: Sequence[int], media_ids: frozenset[int], per_medium: Sequence[int]
) -> tuple[int, ...]:
    """`tokens` with each run of media positions (one image or video) replaced by ids from that
    medium's hash (`media_hashes`: Qwen-style grids split the pixels per medium; otherwise the
    whole request's media stand for every run)."""
    key: list[int] = []
    run = -1
    previous_media = False
    offset = 0
    for token in tokens:
        if token in media_ids:
            if not previous_media:
                run += 1
                offset = 0
            digest = per_medium[run] if run < len(per_medium) else per_medium[-1]
            key.append(MEDIA_KEY_BASE + (digest << 16) + offset % (1 << 16))
            offset += 1
            previous_media = True
        else:
            key.append(int(token))
            previous_media = False
    return tuple(key)


def template_owner(processor: Any) -> Any:
    """What renders the chat template: the processor, or its tokenizer where only the tokenizer
    has one (mlx-vlm's own LLaVA processor is built without the directory's template, which it
    puts on the tokenizer; mlx-vlm's prompt utilities fall back to the tokenizer the same way)."""
    tokenizer = getattr(processor, "tokenizer", None)
    if getattr(processor, "chat_template", None) is None and (
        getattr(tokenizer, "chat_template", None) is not None
    ):
        return tokenizer
    return processor


def render_and_process(
    vlm: VisionProcessing,
    preparer: RequestPreparer,
    templated: list[dict[str, Any]],
    refs: Sequence[MediaRef],
    loaded: Sequence[Any],
    policy: MediaPolicy,
    args: ChatArgs,
) -> MultimodalRequest:
    """On a worker thread: decode, template, process, validate (see the module). Of `args`,
    the tools, the chat-template keywords and the sampling are used here (its messages and
    media arrive as `templated`, `refs` and `loaded`)."""
    images: list[Any] = []
    videos: list[list[Any]] = []
    for ref, data in zip(refs, loaded, strict=True):
        if ref.kind == "image":
            images.append(
                data if not isinstance(data, bytes) else decode_image(data, ref.param, policy)
            )
        else:
            if not isinstance(data, bytes):
                raise InvalidRequest("a video must be given as a URL or a path", param=ref.param)
            videos.append(decode_video(data, ref.param, policy))
    processor = vlm.processor
    kwargs = dict(args.chat_template_kwargs or {})
    if args.tools:
        kwargs["tools"] = list(args.tools)
    try:
        prompt = template_owner(processor).apply_chat_template(
            templated, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:
        raise InvalidRequest(
            f"the model's chat template cannot render these messages: {exc}", param="messages"
        ) from exc
    with preparer._lock:
        try:
            # no keywords but the media it has (one prompt is never padded): a processor
            # without video support (mlx-vlm's LLaVA) hands the keywords it does not know to
            # its image processor, which refuses them
            media: dict[str, Any] = {"videos": videos} if videos else {}
            out = processor(text=[prompt], images=images or None, **media)
        except Exception as exc:
            param = refs[0].param if refs else "messages"
            raise media_error(param, f"the model's processor refused the media: {exc}") from exc
        arrays = {k: _numpy(v) for k, v in dict(out).items()}
        ids = np.asarray(arrays.pop("input_ids")).reshape(-1).tolist()
        arrays.pop("attention_mask", None)
        request = preparer._prepare(ids, "messages", args.sampling)
    media_ids = frozenset(t for t in (vlm.image_token_id, vlm.video_token_id) if t is not None)
    media_key, per_medium = media_hashes(arrays)
    vision = VisionInputs(
        arrays=arrays, media_key=media_key, images=len(images), videos=len(videos)
    )
    # every field of the prepared request (its grammar, processors, reasoning tags, ...) as
    # the text path's, but the system prefix: a prompt with media is cached by its media key
    prepared = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    return MultimodalRequest(
        **(prepared | {"system_prefix": None}),
        vision=vision,
        cache_key=_media_cache_key(request.prompt_tokens, media_ids, per_medium),
    )


async def prepare_multimodal_chat(
    vlm: VisionProcessing,
    preparer: RequestPreparer,
    worker: PreparationQueue,
    args: ChatArgs,
    policy: MediaPolicy,
) -> MultimodalRequest:
    """The whole of stage one for a chat with media (`args.messages`, and `args.images` /
    `args.videos` added to the last user message; see the module). Cancelling the caller
    stops a fetch at once; decoding and processing on the worker are abandoned (as the text
    path's tokenization)."""
    templated, refs = split_media(add_media(args.messages, args.images, args.videos))
    check_media(refs, vlm, policy)
    loaded = await load_media(refs, policy)

    def work() -> MultimodalRequest:
        return render_and_process(vlm, preparer, templated, refs, loaded, policy, args)

    return await worker.run(work)
