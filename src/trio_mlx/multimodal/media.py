"""Fetching and decoding the media a request names. Trio side and worker threads, never the
runner.

Sources, each under `MediaPolicy`:
- `data:` URLs (base64 or percent-encoded), decoded in memory;
- `http://` / `https://` URLs, fetched with a size limit (`max_bytes`, checked against
  Content-Length and while reading), a time limit for the whole fetch (`fetch_timeout`) and a
  redirect limit (`max_redirects`, each hop checked again). Every address the host name resolves
  to must be a public one unless `allow_private_urls`: the connection is made to the address that
  was checked (`_GuardedBackend`), so a name that resolves differently the second time (DNS
  rebinding) cannot reach the host's network either. A server that fetches what clients name must
  not become a way into the network it sits in;
- local files (a path or `file://`), only inside `allowed_local_dir`, after resolving symlinks;
  the engine API's own `images=` / `videos=` arguments are the calling program's and may name any
  file (`MediaPolicy.trusted`).

Every refusal is an `InvalidRequest` whose `param` names the part (`messages[1].content[0]
.image_url`): a bad input is a 400, never a 500. Decoding (`decode_image`, `decode_video`) is
CPU work for a worker thread: Pillow with a pixel limit; video through OpenCV, `video_fps` frames
a second, at most `video_max_frames`, evenly spread, read in order (seeking only past long gaps).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import ipaddress
import os
import tempfile
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from trio_mlx.errors import InvalidRequest

#: Image formats accepted (Pillow's names).
IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class MediaPolicy:
    """What a request may make the server fetch and decode.

    - `allowed_local_dir`: local files are read only inside this directory (None: never);
    - `allow_private_urls`: allow URLs whose host resolves to a private, loopback, link-local or
      otherwise non-public address (off: a client cannot make the server reach its own network);
    - `max_bytes`: the largest media file, fetched or decoded from a data URL;
    - `fetch_timeout`: seconds for one whole fetch (connect, redirects, body);
    - `max_redirects`: redirects followed per fetch;
    - `max_images`: images (and videos) in one request;
    - `max_image_pixels`: the largest decoded image (width x height);
    - `video_fps`, `video_max_frames`: frames sampled from a video;
    - `trusted`: the caller's own arguments (the engine API's `images=` / `videos=`): local files
      anywhere.
    """

    allowed_local_dir: Path | None = None
    allow_private_urls: bool = False
    max_bytes: int = 20 * 1024 * 1024
    fetch_timeout: float = 10.0
    max_redirects: int = 3
    max_images: int = 8
    max_image_pixels: int = 40_000_000
    video_fps: float = 2.0
    video_max_frames: int = 16
    trusted: bool = False

    def as_trusted(self) -> MediaPolicy:
        return dataclasses.replace(self, trusted=True)


class InvalidMedia(InvalidRequest):
    """A media part that cannot be used: unreadable, undecodable, too large, unsupported."""

    code = "invalid_media"


class MediaNotAllowed(InvalidMedia):
    """A media source this server's policy refuses (a private address, a local file)."""

    code = "media_not_allowed"


def media_error(param: str, message: str, code: str = "invalid_media") -> InvalidMedia:
    """The 400 for a bad media part (`code` "media_not_allowed" for a refusal by policy)."""
    kind = MediaNotAllowed if code == "media_not_allowed" else InvalidMedia
    return kind(message, param=param)


# ---- fetching ---------------------------------------------------------------------------------


async def fetch_media(source: str, param: str, policy: MediaPolicy) -> bytes:
    """The bytes `source` names (a data URL, an http(s) URL or a local path), under `policy`."""
    if not isinstance(source, str) or not source:
        raise media_error(param, "a media part needs a URL or a path")
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme == "data":
        return _data_url(source, param, policy)
    if scheme in ("http", "https"):
        try:
            with trio.fail_after(policy.fetch_timeout):
                return await _fetch_http(source, param, policy)
        except trio.TooSlowError:
            raise media_error(
                param, f"fetching the media took longer than {policy.fetch_timeout:g} s"
            ) from None
    if scheme == "file" or scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        path = urllib.parse.unquote(urllib.parse.urlsplit(source).path) if scheme else source
        return await trio.to_thread.run_sync(_read_local, path, param, policy)
    raise media_error(param, f"unsupported media URL scheme {scheme!r} (use data:, http(s):)")


def _data_url(source: str, param: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = source.partition(",")
    if not comma:
        raise media_error(param, "a data URL needs a comma before its data")
    # Decoded size is 3/4 of base64's: refuse a huge one before decoding it.
    if len(payload) * 3 // 4 > policy.max_bytes + 3:
        raise _too_large(param, policy)
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise media_error(param, "the data URL is not valid base64") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > policy.max_bytes:
        raise _too_large(param, policy)
    return data


def _too_large(param: str, policy: MediaPolicy) -> InvalidMedia:
    return media_error(
        param, f"the media is larger than this server's limit of {policy.max_bytes} bytes"
    )


def _read_local(path: str, param: str, policy: MediaPolicy) -> bytes:
    if not policy.trusted:
        if policy.allowed_local_dir is None:
            raise media_error(
                param,
                "local files are not allowed (the server was started without "
                "--allowed-local-media-path)",
                code="media_not_allowed",
            )
        root = policy.allowed_local_dir.resolve()
        target = (root / Path(path).expanduser()).resolve()
        if not target.is_relative_to(root):
            raise media_error(
                param, f"{path}: outside the allowed media directory", code="media_not_allowed"
            )
    else:
        target = Path(path).expanduser()
    try:
        size = target.stat().st_size
        if size > policy.max_bytes:
            raise _too_large(param, policy)
        return target.read_bytes()
    except OSError as exc:
        raise media_error(param, f"{path}: cannot read the file ({exc.strerror})") from None


def address_allowed(address: str) -> bool:
    """A public (globally routable) unicast address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class _Refused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _guarded_backend(policy: MediaPolicy) -> Any:
    from httpcore._backends.trio import TrioBackend

    class _GuardedBackend(TrioBackend):
        """Connects only to addresses the policy allows, to the very address it checked."""

        async def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
            local_address: str | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> Any:
            try:
                infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
            except OSError as exc:
                raise _Refused(f"cannot resolve {host!r}: {exc}") from None
            addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
            if not addresses:
                raise _Refused(f"{host!r} resolves to no address")
            if not policy.allow_private_urls:
                blocked = [a for a in addresses if not address_allowed(a)]
                if blocked:
                    raise _Refused(
                        f"{host!r} resolves to a private or loopback address ({blocked[0]}); "
                        "the server refuses to fetch it (--allow-private-media-urls)"
                    )
            return await super().connect_tcp(
                addresses[0], port, timeout, local_address, socket_options
            )

    return _GuardedBackend()


async def _fetch_http(url: str, param: str, policy: MediaPolicy) -> bytes:
    import httpcore

    async with httpcore.AsyncConnectionPool(
        network_backend=_guarded_backend(policy), retries=0
    ) as pool:
        for _hop in range(policy.max_redirects + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise media_error(param, f"cannot fetch {url!r}: not an http(s) URL")
            try:
                async with pool.stream(
                    "GET", url, headers=[(b"Accept", b"image/*, video/*, */*")]
                ) as response:
                    if response.status in _REDIRECTS:
                        location = dict((k.lower(), v) for k, v in response.headers).get(
                            b"location"
                        )
                        if not location:
                            raise media_error(param, "a redirect without a Location")
                        url = urllib.parse.urljoin(url, location.decode("latin-1"))
                        continue
                    if response.status != 200:
                        raise media_error(
                            param, f"fetching the media answered HTTP {response.status}"
                        )
                    return await _read_body(response, param, policy)
            except _Refused as exc:
                raise media_error(param, exc.message, code="media_not_allowed") from None
            except httpcore.TimeoutException:
                raise media_error(param, "fetching the media timed out") from None
            except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol):
                raise media_error(param, f"cannot fetch {url!r}: unreachable") from None
        raise media_error(param, f"more than {policy.max_redirects} redirects")


async def _read_body(response: Any, param: str, policy: MediaPolicy) -> bytes:
    headers = {k.lower(): v for k, v in response.headers}
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > policy.max_bytes:
        raise _too_large(param, policy)
    body = bytearray()
    async for chunk in response.aiter_stream():
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_large(param, policy)
    return bytes(body)


# ---- decoding (worker thread) -----------------------------------------------------------------


def decode_image(data: bytes, param: str, policy: MediaPolicy) -> Any:
    """A PIL image (RGB) from encoded bytes; refuses unknown formats, too many pixels and bytes
    that do not decode."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
            width, height = probe.size
        if fmt not in IMAGE_FORMATS:
            raise media_error(param, f"unsupported image format {fmt!r}")
        if width * height > policy.max_image_pixels:
            raise media_error(
                param,
                f"the image is {width}x{height}, more than this server's limit of "
                f"{policy.max_image_pixels} pixels",
            )
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise media_error(param, "the image cannot be decoded") from None


#: `decode_video` reaches a pick by decoding the frames before it (`grab`) when it has at most
#: this many to skip, by a seek when more. A seek costs at least 16 frame decodes (below) plus the
#: distance back to a keyframe; 32 is about where the two cost the same with keyframes 1-2 s
#: apart at 30 fps.
SEQUENTIAL_GAP = 32


def sample_indices(count: int, fps: float, policy: MediaPolicy) -> list[int]:
    """The frames `decode_video` takes from a video of `count` frames at `fps`: `video_fps` a
    second, at most `video_max_frames`, evenly spread, first and last included."""
    wanted = max(1, min(policy.video_max_frames, round(count / fps * policy.video_fps)))
    return sorted({round(i * (count - 1) / max(wanted - 1, 1)) for i in range(wanted)})


def decode_video(data: bytes, param: str, policy: MediaPolicy) -> Any:
    """Frames sampled from an encoded video (`sample_indices`), as one uint8 array of shape
    (frames, 3, height, width), RGB: what mlx-vlm's own `load_video` hands its processors. An odd
    number of frames gets its last frame again (Qwen-VL's temporal patches of two).

    The frames are read in order, each pick reached by decoding the frames between it and the
    last one read (`grab`: decoded, not converted) or, past `SEQUENTIAL_GAP` of them, by a seek.
    OpenCV's seek (`CAP_PROP_POS_FRAMES`) goes back to a keyframe at least 16 frames before its
    target and decodes forward from there: seeking to every pick, as mlx-vlm's `load_video`
    does, decodes each frame of a dense sample many times over (all 16 frames of a 16-frame
    448x448 MJPEG clip: 136 decodes instead of 16). The frames are the same either way."""
    import cv2
    import numpy as np

    with tempfile.NamedTemporaryFile(suffix=".video") as file:
        file.write(data)
        file.flush()
        capture = cv2.VideoCapture(file.name)
        try:
            if not capture.isOpened():
                raise media_error(param, "the video cannot be decoded")
            count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
            fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0) or 25.0
            if count <= 0:
                raise media_error(param, "the video has no frames")
            frames = []
            position = 0  # the frame the next read returns (-1: unknown, seek)
            for index in sample_indices(count, fps, policy):
                skip = index - position  # frames to decode through before the pick
                if position < 0 or not 0 <= skip <= SEQUENTIAL_GAP:
                    capture.set(cv2.CAP_PROP_POS_FRAMES, index)
                    skip = 0
                while skip and capture.grab():
                    skip -= 1
                ok, frame = (False, None) if skip else capture.read()
                position = index + 1 if ok else -1
                if not ok or frame is None:
                    continue
                height, width = frame.shape[:2]
                if width * height > policy.max_image_pixels:
                    raise media_error(param, "the video's frames are too large")
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        finally:
            capture.release()
    if not frames:
        raise media_error(param, "the video cannot be decoded")
    if len(frames) % 2:  # temporal patches of two frames (Qwen-VL): repeat the last one
        frames.append(frames[-1])
    return np.stack(frames).transpose(0, 3, 1, 2)
