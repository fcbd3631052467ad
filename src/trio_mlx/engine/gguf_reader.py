"""Read and validate the header of a GGUF file: its metadata and the table of its tensors.

GGUF (llama.cpp's model file) is little-endian: the magic `GGUF`, a version, the tensor and
metadata counts, the metadata key/value pairs, one info record per tensor (name, dimensions
innermost first, GGML type, offset into the data section), padding to the alignment, then the
tensor data. This module parses all of that in pure Python and checks every length and offset
against the file's size *before* any native loader touches the file, so that a truncated download
or a corrupt file becomes a `ModelLoadError` naming the file and the reason rather than a crash.

Tensor data is not read here (except on request, as raw bytes); `mlx.core.load` reads it.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trio_mlx.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4


@dataclass(frozen=True)
class GGMLType:
    """A GGML tensor type: `block_size` values are stored in `block_bytes` bytes."""

    id: int
    name: str
    block_size: int
    block_bytes: int


#: The tensor types whose storage size this reader knows (enough to bound-check any llama file).
GGML_TYPES: Mapping[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 36),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
    )
}

# Metadata value types: (struct format, numpy dtype) for the fixed-size ones.
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
_FIXED: Mapping[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: `shape` in MLX order (outermost first), `offset` absolute."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file but the tensor data.

    `metadata` values are plain Python: `int`, `float`, `bool`, `str`, or a list of those (numeric
    arrays arrive as lists too). `tensors` keeps the file's order.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int


class _Corrupt(Exception):
    """Internal: the header does not fit the file; the message says where."""


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buffer: mmap.mmap | bytes, size: int) -> None:
        self.buffer = buffer
        self.size = size
        self.pos = 0

    def take(self, count: int, what: str) -> int:
        """Advance over `count` bytes; returns where they start."""
        if count < 0 or count > self.size - self.pos:
            raise _Corrupt(f"{what} at byte {self.pos} runs past the end of the file")
        start = self.pos
        self.pos += count
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buffer, start)[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        start = self.take(length, what)
        try:
            return bytes(self.buffer[start : start + length]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Corrupt(f"{what} at byte {start} is not UTF-8") from exc


def _read_value(cursor: _Cursor, kind: int, what: str) -> Any:
    if kind == _FLOAT32:
        # The shortest decimal that is the same float32: 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(cursor.scalar("<f", what))))
    if kind in _FIXED:
        return cursor.scalar(_FIXED[kind][0], what)
    if kind == _STRING:
        return cursor.string(what)
    if kind == _ARRAY:
        item_kind = cursor.scalar("<I", what)
        count = cursor.scalar("<Q", what)
        if item_kind in _FIXED:
            dtype = np.dtype(_FIXED[item_kind][1])
            start = cursor.take(count * dtype.itemsize, what)
            values = np.frombuffer(cursor.buffer, dtype=dtype, count=count, offset=start)
            return values.tolist()
        if item_kind == _STRING:
            # Each string is at least its 8-byte length: reject absurd counts before looping.
            if count > (cursor.size - cursor.pos) // 8:
                raise _Corrupt(f"{what} at byte {cursor.pos} runs past the end of the file")
            return [cursor.string(what) for _ in range(count)]
        raise _Corrupt(f"{what} is an array of unsupported value type {item_kind}")
    raise _Corrupt(f"{what} has unknown value type {kind}")


def _parse(cursor: _Cursor, path: Path) -> GGUFHeader:
    start = cursor.take(4, "the magic")
    magic = bytes(cursor.buffer[start : start + 4])
    if magic != GGUF_MAGIC:
        raise _Corrupt(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    version = cursor.scalar("<I", "the version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version >> 16 in (2, 3):
            raise _Corrupt("a big-endian GGUF file, which is not supported")
        raise _Corrupt(f"unsupported GGUF version {version} (2 and 3 are supported)")
    n_tensors = cursor.scalar("<Q", "the tensor count")
    n_kv = cursor.scalar("<Q", "the metadata count")
    # Every key/value takes at least 12 bytes and every tensor info at least 28.
    if n_kv * 12 + n_tensors * 28 > cursor.size:
        raise _Corrupt(f"its counts ({n_tensors} tensors, {n_kv} metadata keys) exceed its size")

    metadata: dict[str, Any] = {}
    for index in range(n_kv):
        key = cursor.string(f"metadata key #{index}")
        kind = cursor.scalar("<I", f"the type of metadata {key!r}")
        metadata[key] = _read_value(cursor, kind, f"metadata {key!r}")

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")

    infos: list[tuple[str, tuple[int, ...], GGMLType, int]] = []
    for index in range(n_tensors):
        name = cursor.string(f"the name of tensor #{index}")
        n_dims = cursor.scalar("<I", f"tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack_from(
            f"<{n_dims}Q", cursor.buffer, cursor.take(8 * n_dims, f"tensor {name!r}")
        )
        type_id = cursor.scalar("<I", f"tensor {name!r}")
        offset = cursor.scalar("<Q", f"tensor {name!r}")
        ggml_type = GGML_TYPES.get(type_id)
        if ggml_type is None:
            raise _Corrupt(f"tensor {name!r} has unknown GGML type {type_id}")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))

    data_offset = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
        count = math.prod(shape)
        if shape[-1] % ggml_type.block_size or any(d == 0 for d in shape):
            raise _Corrupt(
                f"tensor {name!r} of shape {shape} does not fill whole {ggml_type.name} blocks"
            )
        nbytes = count // ggml_type.block_size * ggml_type.block_bytes
        start = data_offset + offset
        if offset % alignment:
            raise _Corrupt(f"tensor {name!r} has a misaligned data offset {offset}")
        if start + nbytes > cursor.size:
            raise _Corrupt(
                f"tensor {name!r} needs bytes {start}..{start + nbytes} but the file has "
                f"{cursor.size} (an incomplete download?)"
            )
        if name in tensors:
            raise _Corrupt(f"tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    return GGUFHeader(path, version, metadata, tensors, data_offset, cursor.size)


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and validate `path`'s GGUF header against the file's size.

    Raises `ModelLoadError` naming the file and the reason when it is missing, unreadable, not a
    GGUF file, of an unsupported version, or inconsistent with its own size (truncated).
    """
    try:
        with path.open("rb") as file:
            size = file.seek(0, 2)
            if size < 24:
                raise ModelLoadError(f"{path}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return _parse(_Cursor(mapped, size), path)
    except _Corrupt as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelLoadError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def read_tensor_bytes(header: GGUFHeader, name: str) -> bytes:
    """The raw stored bytes of one tensor (for types the native loader would convert lossily)."""
    info = header.tensors[name]
    try:
        with header.path.open("rb") as file:
            file.seek(info.offset)
            data = file.read(info.nbytes)
    except OSError as exc:
        raise ModelLoadError(f"{header.path}: cannot read tensor {name!r}: {exc}") from exc
    if len(data) != info.nbytes:
        raise ModelLoadError(f"{header.path}: tensor {name!r} is truncated (file changed?)")
    return data
