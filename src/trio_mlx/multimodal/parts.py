"""OpenAI content parts with media -> the messages a processor's chat template takes, and the
list of media to fetch. Pure Python: no I/O, no MLX.

Accepted parts (in `messages[i].content`, a list):
- chat completions: `{"type": "image_url", "image_url": {"url": ...}}` (or the URL as a string),
  `{"type": "video_url", "video_url": {"url": ...}}`;
- Responses: `{"type": "input_image", "image_url": ...}`;
- Hugging Face / mlx-vlm style: `{"type": "image", "image": ...}`, `{"type": "video", ...}`;
- text parts: `text`, `input_text`, `output_text` (and `refusal`).

Each media part becomes `{"type": "image"}` / `{"type": "video"}` in the templated message (the
template puts its placeholder there) and a `MediaRef` naming where it came from, so that every
error about it names the part: `messages[1].content[0].image_url`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trio_mlx.errors import InvalidRequest

MediaKind = Literal["image", "video"]
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
#: part type -> (media kind, the field that holds the source)
MEDIA_PARTS: dict[str, tuple[MediaKind, str]] = {
    "image_url": ("image", "image_url"),
    "input_image": ("image", "image_url"),
    "image": ("image", "image"),
    "video_url": ("video", "video_url"),
    "video": ("video", "video"),
}


@dataclass(frozen=True)
class MediaRef:
    """One media input: its kind, where to get it (a URL or path string, raw bytes, or a PIL
    image from the engine API), and the request field it came from (`param`)."""

    kind: MediaKind
    source: Any
    param: str
    #: given by the calling program (`images=` / `videos=`), not by a request body
    trusted: bool = False


def is_media_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in MEDIA_PARTS


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message's content holds a media part."""
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(is_media_part(p) for p in content):
            return True
    return False


def first_media_param(messages: Sequence[Mapping[str, Any]], prefix: str = "messages") -> str:
    """The field of the first media part (for "this model takes text only")."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if is_media_part(part):
                    return f"{prefix}[{i}].content[{j}].{MEDIA_PARTS[part['type']][1]}"
    return prefix


def _source(part: Mapping[str, Any], field: str, param: str) -> Any:
    value = part.get(field)
    if value is None and field == "image":
        value = part.get("url")
    if isinstance(value, Mapping):
        value = value.get("url")
    if value is None or (isinstance(value, str) and not value):
        raise InvalidRequest(f"a {part['type']} part needs a URL", param=param)
    return value


def split_media(
    messages: Sequence[Mapping[str, Any]], *, prefix: str = "messages"
) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """The messages for the processor's chat template, and the media in prompt order."""
    templated: list[dict[str, Any]] = []
    media: list[MediaRef] = []
    for i, message in enumerate(messages):
        item = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                where = f"{prefix}[{i}].content[{j}]"
                if not isinstance(part, Mapping):
                    raise InvalidRequest("a content part must be an object", param=where)
                kind = part.get("type")
                if kind in MEDIA_PARTS:
                    media_kind, field = MEDIA_PARTS[kind]
                    given = part.get("_param")
                    param = given if isinstance(given, str) else f"{where}.{field}"
                    source = _source(part, field, param)
                    media.append(MediaRef(media_kind, source, param, trusted=given is not None))
                    parts.append({"type": media_kind})
                elif kind in TEXT_PARTS or kind == "refusal":
                    text = part.get("text") if kind != "refusal" else part.get("refusal")
                    if not isinstance(text, str):
                        raise InvalidRequest("a text part needs `text`", param=f"{where}.text")
                    parts.append({"type": "text", "text": text})
                else:
                    raise InvalidRequest(
                        f"content parts of type {kind!r} are not supported", param=f"{where}.type"
                    )
            item["content"] = parts
        templated.append(item)
    return templated, media


def add_media(
    messages: Sequence[Mapping[str, Any]],
    images: Sequence[Any] | None,
    videos: Sequence[Any] | None,
) -> list[dict[str, Any]]:
    """vllm-mlx's `images=` / `videos=`: the media go, in order and before its text, into the
    last user message (as `image` / `video` parts, so `split_media` names them
    `images[k]` / `videos[k]`)."""
    out = [dict(m) for m in messages]
    extra: list[dict[str, Any]] = []
    for k, image in enumerate(images or ()):
        extra.append({"type": "image", "image": image, "_param": f"images[{k}]"})
    for k, video in enumerate(videos or ()):
        extra.append({"type": "video", "video": video, "_param": f"videos[{k}]"})
    if not extra:
        return out
    for message in reversed(out):
        if message.get("role") == "user":
            content = message.get("content")
            text = [{"type": "text", "text": content}] if isinstance(content, str) else []
            listed = list(content) if isinstance(content, list) else []
            message["content"] = extra + listed + text
            return out
    raise InvalidRequest("images and videos need a user message to go with", param="messages")
