"""Images, videos and a loopback media server for the multimodal tests."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import numpy as np
import trio
from PIL import Image


def image(seed: int, size: tuple[int, int] = (56, 56)) -> Image.Image:
    """A random RGB image (width, height)."""
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    buffer = io.BytesIO()
    image(seed, size).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, text: str = "What is in this image?") -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


def write_video(
    path: Path, frames: int = 8, size: tuple[int, int] = (56, 56), fps: int = 4, seed: int = 100
) -> Path:
    """A short MJPG video of random frames (frame k: `image(seed + k)`)."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, size)
    for k in range(frames):
        writer.write(np.asarray(image(seed + k, size))[:, :, ::-1].copy())
    writer.release()
    return path


@asynccontextmanager
async def media_server(
    files: dict[str, bytes], *, stall: trio.Event | None = None
) -> AsyncIterator[tuple[str, Callable[[], Awaitable[None]]]]:
    """A loopback HTTP/1.0 server answering GET /NAME with `files[NAME]` (404 otherwise), or,
    with `stall`, accepting and never answering (it sets `stall` once a request arrived).
    Yields its base URL and a `wait_request` (returns once a request has arrived)."""
    arrived = trio.Event()

    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        with trio.move_on_after(10):
            while b"\r\n\r\n" not in request:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                request += chunk
        arrived.set()
        if stall is not None:
            stall.set()
            await trio.sleep_forever()
        path = request.split(b" ", 2)[1].decode().lstrip("/")
        body = files.get(path)
        if body is None:
            await stream.send_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        else:
            head = (
                f"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            await stream.send_all(head.encode() + body)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}", arrived.wait
        nursery.cancel_scope.cancel()
