"""Safetensors I/O at the byte level: header parsing, ranged reads, streaming writes.

Why hand-written: the `safetensors` library reads through mmap (every touched
page then counts in the process RSS) and writes only whole in-memory dicts
(`save_file`). Converting a trillion-parameter checkpoint needs the opposite:
read one tensor or one expert slice with `pread`, and write a file whose
header is known up front, filling its data region slice by slice with
`pwrite`. The format is tiny (8-byte little-endian header length, JSON header,
raw row-major data) and the files written here are read back by `safe_open`
in the tests, so the two stay compatible.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.core.errors import UserError

# safetensors dtype tag <-> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # MXFP4 scales as some releases tag them
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
TAGS: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors reference limit


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype tag, shape, absolute byte range."""

    name: str
    file: str  # absolute path
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a safetensors file's header without touching tensor data.

    Args:
        path: the `.safetensors` file.

    Returns:
        ({name: TensorInfo}, metadata). Raises UserError naming the file on a
        truncated file, corrupt header JSON, unknown dtype or inconsistent offsets.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise UserError(f"{path}: truncated or corrupt safetensors header "
                            f"(header length {hlen}, file size {size})")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: corrupt safetensors header JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        out[name] = _tensor_info(path, name, entry, base, size)
    return out, meta


def _tensor_info(path: Path, name: str, entry, base: int, size: int) -> TensorInfo:
    try:
        dtype, shape, (lo, hi) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{path}: tensor {name}: malformed header entry {entry!r}") from None
    if dtype not in DTYPES:
        raise UserError(f"{path}: tensor {name}: unsupported dtype {dtype}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    if hi - lo != numel * itemsize or lo < 0:
        raise UserError(f"{path}: tensor {name}: byte range {lo}..{hi} does not fit shape "
                        f"{list(shape)} {dtype}")
    if base + hi > size:
        raise UserError(f"{path}: truncated: tensor {name} ends at byte {base + hi}, "
                        f"file has {size}")
    return TensorInfo(name, str(path), dtype, shape, base + lo, base + hi)


def read_rows(info: TensorInfo, start: int = 0, stop: int | None = None,
              fd: int | None = None) -> torch.Tensor:
    """Read rows [start, stop) of dim 0 of a tensor with one `pread` (no mmap).

    Args:
        fd: an open descriptor of `info.file` to reuse (else one is opened and closed).

    Returns:
        A tensor of shape [stop - start, *shape[1:]] owning its memory.
    """
    shape = info.shape
    if not shape:
        start, stop, rows = 0, 1, 1
    else:
        stop = shape[0] if stop is None else stop
        rows = stop - start
    row_bytes = info.nbytes // (shape[0] if shape and shape[0] else 1) if shape else info.nbytes
    buf = bytearray(rows * row_bytes)
    if buf:
        own = fd is None
        handle = os.open(info.file, os.O_RDONLY) if fd is None else fd
        try:
            view, got, pos = memoryview(buf), 0, info.start + start * row_bytes
            while got < len(buf):  # a large pread may return short
                n = os.preadv(handle, [view[got:]], pos + got)
                if n == 0:
                    raise UserError(f"{info.file}: truncated while reading tensor {info.name}")
                got += n
        finally:
            if own:
                os.close(handle)
    t = torch.frombuffer(buf, dtype=info.torch_dtype) if buf else torch.empty(0, dtype=info.torch_dtype)
    return t.reshape((rows, *shape[1:]) if shape else ())


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """The whole tensor (memory: its own size)."""
    return read_rows(info)


class StreamWriter:
    """Write one safetensors file whose tensor list is known before any data.

    The header (names, dtypes, shapes, offsets) is written first; tensor data is
    then filled in slices with `pwrite` at known offsets, in any order. Data is
    written to `<path>.tmp` and renamed on `close()`, so a crash never leaves a
    file that looks complete.
    """

    def __init__(self, path: str | Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for name, dtype, shape in tensors:
            numel = 1
            for d in shape:
                numel *= d
            n = numel * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": TAGS[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.offsets[name] = (pos, pos + n)
            pos += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the reference writer does
        self.base = 8 + len(blob)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(blob)) + blob, 0)
        os.ftruncate(self.fd, self.base + pos)

    def write(self, name: str, byte_offset: int, tensor: torch.Tensor) -> None:
        """Write `tensor`'s bytes at `byte_offset` inside tensor `name`'s data."""
        data = tensor_bytes(tensor) if tensor.numel() else b""  # keeps `tensor` alive
        lo, hi = self.offsets[name]
        if lo + byte_offset + len(data) > hi:
            raise ValueError(f"write past the end of {name} in {self.path}")
        os.pwrite(self.fd, data, self.base + lo + byte_offset)

    def close(self) -> Path:
        # No fsync: the rename is what makes a file "complete" for a crashed or
        # interrupted process; durability across a host crash is the storage's job
        # (an fsync per file would serialise the run on disk writeback).
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        try:
            os.close(self.fd)
        finally:
            self.tmp.unlink(missing_ok=True)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw row-major bytes of a tensor (what safetensors stores), without a copy."""
    # ndarray has the buffer protocol; numpy's stubs do not declare it
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def release_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc `malloc_trim`). Called between
    streaming steps: glibc raises its mmap threshold after a large tensor is freed, so the
    next step's slices come from the heap, and the pages freed by earlier steps stay
    resident unless trimmed: the process would hold about twice the step it works on.
    No-op where the C library is not glibc."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _LIBC = None


@contextlib.contextmanager
def single_thread():
    """Run torch ops on one thread: conversion is memory-bound copies of small
    slices, where intra-op threads only add barrier waits (several times slower
    on a busy host); parallelism comes from one task per output file."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
