"""Byte-copy path: plan groups whose output bytes are the source bytes, rearranged.

Most of a BF16 MoE checkpoint converted to BF16 is such a group: renamed
tensors, and per-expert matrices stacked (and concatenated along dim 1) into
fused expert tensors — the output row of expert e is gate_e's bytes followed
by up_e's. For these, nothing needs to pass through torch: each byte range is
copied in cache-sized pieces through one reused buffer — pread, hash, NaN/Inf
test on the bits, pwrite — so the data crosses memory no more often than with
`cp` (benchmarks/bench_convert.py times it against `cp -r`, in GB/s; kernel
copy_file_range plus a separate hashing pass was slower).

Which ranges go where is not written down per family: it is *measured* by
running the group's own transformers converter (the same `run_step` as the
torch path) on int32 tensors whose values are element ids, for the first and
the last step unit (one expert per chunk, or one row). The output ids give
the runs of consecutive source elements; the layout is used only if both
units give the same runs (so it holds for every unit), every source element
lands exactly once, and the runs are long. Anything else (casts, FP8
dequantisation, transposes, whole-mode groups) takes the torch path. The
verifier recomputes every tensor by the torch path, independently of this one.

Memory: a probe holds one step unit's ids (4 bytes per source element);
copying holds two PIECE buffers.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from moeflow.checkpoint.engine import run_step
from moeflow.checkpoint.st_io import DTYPES, TensorInfo
from moeflow.core.errors import UserError

PIECE = 256 << 10  # bytes per read/hash/test/write (stays in the CPU cache between them)
MIN_RUN = 4096  # bytes: shorter average runs (e.g. transposes) take the torch path
# Non-finite test per float tag, on the bits: with the sign bit cleared, a value is
# NaN/Inf iff it is >= the all-ones exponent pattern (float8_e4m3fn: NaN only).
_NONFINITE = {"BF16": (np.uint16, 0x7FFF, 0x7F80), "F16": (np.uint16, 0x7FFF, 0x7C00),
              "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
              "F64": (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
              "F8_E4M3": (np.uint8, 0x7F, 0x7F), "F8_E5M2": (np.uint8, 0x7F, 0x7C)}


class _IdLoader:
    """Stands in for engine.Loader in a probe: each source tensor (or row range)
    is int32 element ids, `base[key] + arange(numel)`."""

    def __init__(self, tensors: dict[str, TensorInfo], base: dict[str, int]):
        self.tensors, self.base = tensors, base

    def load(self, key, dtype, scale_key, rows=None) -> torch.Tensor:
        shape = self.tensors[key].shape
        if rows is not None:
            shape = (rows[1] - rows[0], *shape[1:])
        n = _numel(shape)
        return torch.arange(self.base[key], self.base[key] + n, dtype=torch.int32).reshape(shape)


_CACHE: dict = {}  # probe signature -> runs per target (the same for every layer of a model)
_DIGITS = re.compile(r"\d+")


def layout(fam, group: dict, tensors: dict[str, TensorInfo]) -> dict | None:
    """How to build `group`'s outputs by copying source byte ranges, or None.

    Returns:
        {"unit": "tensor"} (the single source's bytes are the output), or
        {"unit": "experts" | "rows", "slots": [(pattern index, chunk)],
         "runs": {target: [(slot, first element, elements)] for one unit}}.
    """
    keys = [k for ks in group["sources"].values() for k in ks]
    if group["scales"] or any(tensors[k].dtype != group["dtype"] or getattr(tensors[k], "parts", None)
                              for k in keys):
        return None  # a cast or dequantisation: torch
    if group["conv"] is None:
        return {"unit": "tensor"}
    if group["mode"] not in ("experts", "rows"):
        return None
    units = _units(group, tensors)
    # every decoder layer has the same structure: probe it once (layer numbers masked)
    sig = (fam.architecture, group["conv"], group["mode"], group["chunks"], group.get("suffix", ""),
           tuple((p, len(ks), tensors[ks[0]].shape) for p, ks in group["sources"].items()),
           tuple((_DIGITS.sub("#", n), tuple(s)) for n, s in group["targets"].items()))
    if sig not in _CACHE:
        first, last = (_probe(fam, group, tensors, u) for u in (0, units - 1))
        _CACHE[sig] = first if first is not None and first == last else None
    runs = _CACHE[sig]
    if runs is None:
        return None
    slots = [(p, j) for p in range(len(group["sources"])) for j in range(group["chunks"])] \
        if group["mode"] == "experts" else [(0, 0)]
    return {"unit": group["mode"], "slots": slots, "runs": dict(zip(group["targets"], runs))}


def _units(group: dict, tensors: dict[str, TensorInfo]) -> int:
    if group["mode"] == "experts":
        return len(next(iter(group["sources"].values()))) // group["chunks"]
    return tensors[next(iter(group["sources"].values()))[0]].shape[0]


def _probe(fam, group: dict, tensors: dict[str, TensorInfo],
           unit: int) -> list[list[tuple[int, int, int]]] | None:
    """Runs of one unit, per target in plan order; None unless it is a clean permutation
    of long runs."""
    if group["mode"] == "experts":
        per = _units(group, tensors)
        selection: dict[str, list[int] | tuple[int, int]] = {
            "experts": [unit + j * per for j in range(group["chunks"])]}
        slot_keys = [ks[unit + j * per] for ks in group["sources"].values() for j in range(group["chunks"])]
        sizes = [_numel(tensors[k].shape) for k in slot_keys]
    else:
        key = next(iter(group["sources"].values()))[0]
        selection, slot_keys = {"rows": (unit, unit + 1)}, [key]
        sizes = [_numel(tensors[key].shape[1:])]
    bases = np.cumsum([0] + sizes)
    if bases[-1] >= 2 ** 31:
        return None
    loader = _IdLoader(tensors, dict(zip(slot_keys, bases[:-1].tolist())))
    try:
        out = run_step(fam, group, loader, selection)
    except Exception:  # an op that does not take integer tensors: torch path
        return None
    itemsize = DTYPES[group["dtype"]].itemsize
    runs, covered = [], []
    for name in group["targets"]:
        t = out[name]
        if t.dtype != torch.int32 or _numel(t.shape) != _numel(group["targets"][name][1:]):
            return None
        ids = t.contiguous().reshape(-1).numpy()
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(ids) != 1) + 1, [ids.size]])
        if ids.size and ids.size * itemsize / (len(cuts) - 1) < MIN_RUN:
            return None  # e.g. a transpose: element-sized runs
        # split runs at slot boundaries (consecutive ids may cross from one source to the next)
        target = []
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            start = int(ids[a])
            while a < b:
                slot = int(np.searchsorted(bases, start, side="right")) - 1
                n = min(b - a, int(bases[slot + 1]) - start)
                target.append((slot, start - int(bases[slot]), n))
                covered.append((start, n))
                a, start = a + n, start + n
        runs.append(target)
    covered.sort()
    pos = 0
    for start, n in covered:
        if start != pos:
            return None  # a source element dropped or duplicated
        pos += n
    return runs if pos == bases[-1] else None


def copy_group(group: dict, lay: dict, tensors: dict[str, TensorInfo], writer, hashers: dict,
               fds, nonfinite: dict[str, int]) -> None:
    """Write `group`'s outputs by copying source ranges into `writer`'s file, hashing
    each output tensor in order and counting NaN/Inf per source tensor.

    Args:
        fds: source path -> open read-only descriptor (engine.Loader.fd).
    """
    buf = bytearray(PIECE)  # reused for every piece
    scratch = np.empty(PIECE, dtype=np.uint8)
    for name in group["targets"]:
        for key, src, dst, n in _coalesce(_copies(group, lay, tensors, writer, name)):
            bad = _copy(tensors[key], fds(tensors[key].file), src, writer.fd, dst, n,
                        hashers[name], buf, scratch)
            if bad:
                nonfinite[key] = nonfinite.get(key, 0) + bad


def _copies(group, lay, tensors, writer, name):
    """(source key, absolute source offset, absolute output offset, bytes), in output order."""
    lo, hi = writer.offsets[name]
    dst = writer.base + lo
    if lay["unit"] == "tensor":
        key = next(iter(group["sources"]))
        yield key, tensors[key].start, dst, hi - lo
        return
    itemsize = DTYPES[group["dtype"]].itemsize
    sources = list(group["sources"].values())
    per = _units(group, tensors)
    runs = lay["runs"][name]
    for u in range(per):
        for slot, first, count in runs:
            if lay["unit"] == "experts":
                p, j = lay["slots"][slot]
                key = sources[p][u + j * per]
                src = tensors[key].start + first * itemsize
            else:
                key = sources[0][0]
                info = tensors[key]
                src = info.start + u * (info.nbytes // info.shape[0]) + first * itemsize
            yield key, src, dst, count * itemsize
            dst += count * itemsize


def _coalesce(copies):
    cur = None
    for key, src, dst, n in copies:
        if cur and cur[0] == key and cur[1] + cur[3] == src and cur[2] + cur[3] == dst:
            cur[3] += n
            continue
        if cur:
            yield tuple(cur)
        cur = [key, src, dst, n]
    if cur:
        yield tuple(cur)


def _copy(info: TensorInfo, src_fd: int, src: int, dst_fd: int, dst: int, n: int, hasher,
          buf: bytearray, scratch: np.ndarray) -> int:
    """Copy n bytes piece by piece: pread, hash, NaN/Inf test, pwrite. Each piece is
    read from memory once and stays in the CPU cache for the other three.

    Returns:
        The number of NaN/Inf values in the copied bytes.
    """
    scan = _NONFINITE.get(info.dtype)
    bad = 0
    with memoryview(buf) as whole:
        while n:
            k = min(n, len(buf))
            with whole[:k] as piece:
                got = 0
                while got < k:  # a pread may return short
                    r = os.preadv(src_fd, [piece[got:]], src + got)
                    if r == 0:
                        raise UserError(f"{info.file}: truncated while reading tensor {info.name}")
                    got += r
                hasher.update(piece)
                if scan is not None:
                    bad += _count_nonfinite(piece, scratch, *scan)
                done = 0
                while done < k:
                    done += os.pwrite(dst_fd, piece[done:], dst + done)
            src, dst, n = src + k, dst + k, n - k
    return bad


def _count_nonfinite(view, scratch: np.ndarray, dtype, mask: int, threshold: int) -> int:
    """NaN/Inf values in `view` (a whole number of elements), through `scratch`."""
    bits = np.frombuffer(view, dtype=dtype)  # [n]
    tmp = scratch.view(dtype)
    bad = 0
    for a in range(0, bits.size, tmp.size):
        piece = bits[a:a + tmp.size]
        cleared = np.bitwise_and(piece, mask, out=tmp[:piece.size])  # sign bit cleared
        if cleared.max() >= threshold:
            bad += int(np.count_nonzero(cleared >= threshold))
    return bad


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
