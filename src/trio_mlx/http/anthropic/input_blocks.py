"""What one content block of a request says, read and checked: a `tool_use` block's call, a
`tool_result`'s text and images, a `document`'s text, an `image`'s URL. `conversation.py` puts
them in their turns.

Each reader refuses what this server does not serve with a 400 naming the block's own field
(`where`: `messages[i].content[j]`, or deeper for a block inside a tool result):

- a call needs its `id`, `name` and `input` (an object), given to the template as the
  arguments' JSON text;
- a tool result's content is a string or text and image blocks: the texts joined by newlines,
  `Error: ` before them when `is_error`, and the images apart, in order;
- a document is read as text: `title`, `context` and the text, one a line, from a `text` source
  (`media_type` `text/plain`) or a `content` source (a string or text blocks); a PDF (`base64`,
  `url`, `file` sources) is refused naming `source.type`, and `citations: {"enabled": true}`
  naming it, as no citations are produced;
- an image's `source` is base64 (a media type of `IMAGE_MEDIA_TYPES`) or a `url`: a URL the
  media fetcher takes (a data URL for base64).
"""

from __future__ import annotations

import json
from typing import Any

from trio_mlx.http.anthropic.requests import IMAGE_MEDIA_TYPES, ContentBlock
from trio_mlx.http.errors import APIError, required_text


def required(value: str | None, where: str, name: str) -> str:
    if value is None:
        raise APIError(
            400,
            f"a block of this type needs `{name}`",
            param=f"{where}.{name}",
            code="missing_required_parameter",
        )
    return value


def tool_call(block: ContentBlock, where: str) -> dict[str, Any]:
    call_id = required(block.id, where, "id")
    name = required(block.name, where, "name")
    if not name:
        raise APIError(400, "a tool_use block needs a name", param=f"{where}.name")
    if block.input is None:
        raise APIError(
            400,
            "a tool_use block needs `input` (an object)",
            param=f"{where}.input",
            code="missing_required_parameter",
        )
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def result_content(block: ContentBlock, where: str) -> tuple[str, list[tuple[str, str]]]:
    """A tool result's text (its text blocks joined by newlines, `Error: ` before it when
    `is_error`) and its images (`(the request block, URL)`), in order."""
    content = block.content
    images: list[tuple[str, str]] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for m, item in enumerate(content):
            item_where = f"{where}.content[{m}]"
            if isinstance(item, dict) and item.get("type") == "image":
                source = item.get("source")
                images.append((item_where, image_url(source, item_where)))
            else:
                texts += _text_items(
                    [item],
                    f"{where}.content",
                    "a tool_result's content may hold text and image blocks only",
                    m,
                )
        text = "\n".join(texts)
    if block.is_error:
        text = f"Error: {text}" if text else "Error"
    return text, images


def document_text(block: ContentBlock, where: str) -> str:
    """A text document as the turn's text: its title, context and text, one a line."""
    citations = block.citations
    if citations is not None:
        if not isinstance(citations, dict):
            raise APIError(
                400,
                'a document\'s citations is an object, {"enabled": false}',
                param=f"{where}.citations",
                code="invalid_value",
            )
        enabled = citations.get("enabled", False)
        if enabled is True:
            raise APIError(
                400,
                "this server produces no citations: leave citations out of the document",
                param=f"{where}.citations.enabled",
                code="unsupported_value",
            )
        if enabled is not False:
            raise APIError(
                400,
                "citations.enabled must be a boolean",
                param=f"{where}.citations.enabled",
                code="invalid_value",
            )
    source = block.source
    param = f"{where}.source"
    if source is None:
        raise APIError(
            400, "a document block needs `source`", param=param, code="missing_required_parameter"
        )
    kind = source.get("type")
    if kind == "text":
        if source.get("media_type", "text/plain") != "text/plain":
            raise APIError(
                400,
                "a text source's media_type must be 'text/plain'",
                param=f"{param}.media_type",
                code="invalid_value",
            )
        text = source.get("data")
        if not isinstance(text, str):
            raise APIError(
                400,
                "a text source needs `data` (the document's text)",
                param=f"{param}.data",
                code="missing_required_parameter",
            )
    elif kind == "content":
        content = source.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "\n".join(
                _text_items(
                    content, f"{param}.content", "a content source may hold text blocks only"
                )
            )
        else:
            raise APIError(
                400,
                "a content source needs `content` (a string or text blocks)",
                param=f"{param}.content",
                code="missing_required_parameter",
            )
    else:
        raise APIError(
            400,
            "only text documents are read by this server (source type 'text' or 'content'); "
            "PDFs (base64, url or file sources) are not: send their text",
            param=f"{param}.type",
            code="unsupported_value" if isinstance(kind, str) else "invalid_value",
        )
    return "\n".join(piece for piece in (block.title, block.context, text) if piece)


def _text_items(items: list[Any], param: str, what: str, first: int = 0) -> list[str]:
    """The texts of a list of text blocks (a document's content; a tool result's, whose images
    are read apart), refusing any other block with a 400 naming it (`param[first + m]`) that
    says `what` the list may hold."""
    texts = []
    for m, item in enumerate(items, start=first):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text" and isinstance(item.get("text"), str):
            texts.append(item["text"])
        elif kind == "text":
            raise APIError(
                400,
                "a text block needs `text`",
                param=f"{param}[{m}].text",
                code="missing_required_parameter",
            )
        else:
            raise APIError(
                400,
                f"{what}, not {kind!r}",
                param=f"{param}[{m}].type",
                code="unsupported_value",
            )
    return texts


def image_url(source: Any, where: str) -> str:
    """The image of the block at `where`, whose `source` is given, as a URL the media fetcher
    takes (a data URL for base64)."""
    param = f"{where}.source"
    if source is not None and not isinstance(source, dict):
        raise APIError(400, "an image's source is an object", param=param, code="invalid_value")
    if source is None:
        raise APIError(
            400, "an image block needs `source`", param=param, code="missing_required_parameter"
        )
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise APIError(
                400,
                f"media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}",
                param=f"{param}.media_type",
                code="invalid_value",
            )
        data = required_text(
            source,
            "data",
            "a base64 source needs `data` (the image, base64-encoded)",
            f"{param}.data",
        )
        return f"data:{media_type};base64,{data}"
    if kind == "url":
        return required_text(source, "url", "a url source needs `url`", f"{param}.url")
    raise APIError(
        400,
        "an image source's type must be 'base64' or 'url'",
        param=f"{param}.type",
        code="unsupported_value" if isinstance(kind, str) else "invalid_value",
    )
