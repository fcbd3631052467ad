"""OpenBLAS for MLX's CPU backend: where MLX's float32 matrix products go.

The `mlx[cpu]` wheel links the reference BLAS (netlib, one plain loop per product), which runs a
float32 matrix product at ~1 GFLOP/s on a laptop-class core; OpenBLAS runs the same product at
50-100 times that. MLX calls exactly three BLAS routines (`cblas_sgemm`, `cblas_dgemm`,
`cblas_cgemm`) through its library's global offset table, so pointing those three slots at
OpenBLAS's routines is all it takes. The OpenBLAS used is the one the `scipy-openblas32` wheel
ships (a trio-mlx dependency; built for every x86-64 and arm64 CPU), whose routines carry a
`scipy_` prefix and so cannot be picked up by the dynamic linker under their plain names.

`use_openblas()` does that once per process, before the first matrix product that matters:
- where MLX's BLAS already resolves to an optimized library (say `LD_PRELOAD` of a system
  OpenBLAS or MKL), it changes nothing and reports that library;
- `TRIO_MLX_BLAS=reference` keeps the reference BLAS (the opt-out);
- elsewhere than Linux, or where MLX's library or the wheel cannot be found, it reports the
  reference BLAS and what would be faster. It never raises.

Writing a pointer-sized slot is atomic, so a product already running on another thread finishes
in the routine it started in; both compute the same function.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: The routines MLX's CPU backend calls, each redirected to OpenBLAS's.
ROUTINES = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
#: Names that mark a BLAS as optimized (everything else is taken as the reference BLAS).
_OPTIMIZED_MARKS = ("openblas", "mkl", "blis", "accelerate", "armpl", "atlas")
#: Relocation types of pointer slots: x86-64 JUMP_SLOT, GLOB_DAT, 64; arm64 the same three.
_POINTER_RELOCATIONS = frozenset({7, 6, 1, 1026, 1025, 257})
_ENV = "TRIO_MLX_BLAS"


@dataclass(frozen=True)
class BlasState:
    """Which BLAS serves MLX's float32 matrix products, and how it came to."""

    optimized: bool
    library: str
    how: str  # "patched", "already loaded", "opt-out", "unavailable"
    detail: str = ""

    def describe(self) -> str:
        """One phrase for the start-up log line."""
        if self.how == "patched":
            return f"OpenBLAS from scipy-openblas32 ({self.detail})"
        if self.optimized:
            return f"{self.library} (already loaded)"
        why = f"; {self.detail}" if self.detail else ""
        return f"the reference BLAS ({self.library}){why}"


_lock = threading.Lock()
_state: BlasState | None = None


def use_openblas() -> BlasState:
    """Point MLX's BLAS routines at OpenBLAS where that helps; return what is in use (cached)."""
    global _state
    with _lock:
        if _state is None:
            try:
                _state = _arrange()
            except Exception as exc:  # a hook that speeds things up must never stop a load
                log.debug("BLAS arrangement failed", exc_info=True)
                _state = BlasState(False, "unknown", "unavailable", f"could not arrange: {exc}")
            log.debug("BLAS: %s", _state)
        return _state


def _arrange() -> BlasState:
    if not sys.platform.startswith("linux"):
        return BlasState(False, "platform default", "unavailable", "only arranged on Linux")
    libmlx = _mapped_library("libmlx.so")
    if libmlx is None:
        return BlasState(False, "unknown", "unavailable", "MLX's library is not loaded")
    path, base = libmlx
    slots = _pointer_slots(path, ROUTINES)
    if "cblas_sgemm" not in slots:
        return BlasState(False, "unknown", "unavailable", "MLX does not call cblas_sgemm")
    current = _library_of(ctypes.c_void_p.from_address(base + slots["cblas_sgemm"]).value)
    if any(mark in Path(current).name.lower() for mark in _OPTIMIZED_MARKS):
        return BlasState(True, Path(current).name, "already loaded")
    if os.environ.get(_ENV, "").strip().lower() == "reference":
        return BlasState(False, Path(current).name, "opt-out", f"{_ENV}=reference")
    openblas = _load_scipy_openblas()
    if openblas is None:
        return BlasState(
            False,
            Path(current).name,
            "unavailable",
            "pip install scipy-openblas32 for ~50x faster float32 products",
        )
    for name, offset in slots.items():
        target = ctypes.cast(getattr(openblas, "scipy_" + name), ctypes.c_void_p).value
        _write_pointer(base + offset, target)
    threads = blas_threads()
    if threads is not None:
        openblas.scipy_openblas_set_num_threads(threads)
    openblas.scipy_openblas_get_num_threads.restype = ctypes.c_int
    get_config = openblas.scipy_openblas_get_config
    get_config.restype = ctypes.c_char_p
    config = (get_config() or b"").decode(errors="replace").split(" MAX_THREADS")[0]
    config += f", {openblas.scipy_openblas_get_num_threads()} thread(s)"
    return BlasState(True, Path(openblas._name).name, "patched", config)


def blas_threads() -> int | None:
    """OpenBLAS's thread count: half the CPUs this process may use (at least 1), or None to
    leave OpenBLAS's own choice where `OPENBLAS_NUM_THREADS` is set.

    OpenBLAS's threads spin while they wait for each other; with a thread for every core, any
    other busy process (or this server's own threads) stalls every product. Measured on 2 shared
    cores: 1 thread prefilled 146 tok/s and decoded 8.4, 2 threads 34 and 1.9.
    """
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // 2)


def _load_scipy_openblas() -> ctypes.CDLL | None:
    try:
        import scipy_openblas32  # type: ignore[import-untyped]
    except ImportError:
        return None
    lib = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as exc:
        log.debug("cannot load %s: %s", lib, exc)
        return None


def _mapped_library(name: str) -> tuple[str, int] | None:
    """(path, load base) of the shared library `name` mapped into this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and Path(parts[5]).name == name and int(parts[2], 16) == 0:
                return parts[5], int(parts[0].split("-")[0], 16)
    return None


def _pointer_slots(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """Offsets of the pointer slots (GOT entries) through which `path` calls each of `names`."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            return {}  # only 64-bit little-endian ELF
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [
            struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
        ]
        wanted = set(names)
        slots: dict[str, int] = {}
        for section in sections:
            if section[1] != 4:  # SHT_RELA
                continue
            symtab = sections[section[6]]
            strtab = sections[symtab[6]]
            for at in range(section[4], section[4] + section[5], 24):
                r_offset, r_info = struct.unpack_from("<QQ", data, at)
                if r_info & 0xFFFFFFFF not in _POINTER_RELOCATIONS:
                    continue
                (st_name,) = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * 24)
                start = strtab[4] + st_name
                symbol = bytes(data[start : data.find(b"\0", start)]).decode(errors="replace")
                if symbol in wanted:
                    slots[symbol] = r_offset
        return slots


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _library_of(address: int | None) -> str:
    """The path of the shared library that holds `address` (dladdr), or "unknown"."""
    if not address:
        return "unknown"
    libc = ctypes.CDLL(None)
    info = _DlInfo()
    if libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) == 0 or not info.dli_fname:
        return "unknown"
    return str(info.dli_fname.decode(errors="replace"))


def _write_pointer(address: int, value: int | None) -> None:
    """Store `value` at `address`, lifting a read-only (RELRO) page's protection for the write."""
    page = address & ~(mmap.PAGESIZE - 1)
    writable = _is_writable(address)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if not writable and libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE):
        raise OSError(ctypes.get_errno(), "mprotect failed")
    ctypes.c_void_p.from_address(address).value = value
    if not writable:
        libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ)


def _is_writable(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return perms[1] == "w"
    return False
