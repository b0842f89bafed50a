"""Run one plan group step: read source slices, cast/dequantise, apply the
family's transformers converter, return output slices.

Memory per step: one expert's source tensors (experts mode), one row range
(rows mode) or one source group (whole mode) — never a layer or the model.
"""

from __future__ import annotations

import copy
import os
from typing import Protocol

import torch

from moeflow.checkpoint import formats, fp8
from moeflow.checkpoint.families import Family
from moeflow.checkpoint.st_io import DTYPES, TensorInfo, read_rows
from moeflow.core.errors import UserError


class SliceShapes:
    """Stands in for the model in converter ops that ask for a parameter's shape
    (Transpose(check_dims), Split): the runtime shape with dim 0 cut to the slice."""

    def __init__(self, shapes: dict[str, tuple], rows: int | None):
        self.shapes, self.rows = shapes, rows

    def get_parameter(self, name: str) -> torch.Tensor:
        shape = tuple(self.shapes[name])
        if self.rows is not None and shape:
            shape = (self.rows, *shape[1:])
        return torch.empty(shape, device="meta")


class Reader(Protocol):
    """What `run_step` reads sources through: a `Loader`, or a probe's stand-in
    (moeflow.checkpoint.bytecopy)."""

    def load(self, key: str, dtype: str, scale_key: str | None,
             rows: tuple[int, int] | None = None) -> torch.Tensor: ...


class Loader:
    """Reads source tensors, dequantises FP8 blocks, casts, counts non-finite values."""

    def __init__(self, tensors: dict[str, TensorInfo], block: tuple[int, int] | None):
        self.tensors = tensors
        self.block = block
        self.nonfinite: dict[str, int] = {}
        self._fds: dict[str, int] = {}  # one descriptor per source file (open() is slow here)

    def close(self) -> None:
        """Close the source files this loader opened."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        self.close()

    def fd(self, path: str) -> int:
        """An open read-only descriptor of a source file (kept until close())."""
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def load(self, key: str, dtype: str, scale_key: str | None,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        info = self.tensors[key]
        if isinstance(info, formats.Packed):  # a release format: decoded by its own reader
            t = formats.read(info, rows, fd=self.fd)
        else:
            start, stop = rows or (0, None)
            t = read_rows(info, start, stop, fd=self.fd(info.file))
        if scale_key is not None:
            if self.block is None:
                raise UserError(f"{info.file}: tensor {key} has {scale_key} but config.json has "
                                "no quantization_config.weight_block_size")
            scale = self.tensors[scale_key]
            t = fp8.dequantize(t, read_rows(scale, fd=self.fd(scale.file)), self.block, torch.float32)
        if t.is_floating_point() and t.numel():
            self._count_nonfinite(key, t.float() if t.dtype.itemsize == 1 else t)
        return t.to(DTYPES[dtype])

    def _count_nonfinite(self, key: str, t: torch.Tensor) -> None:
        # aminmax is vectorised for bf16 and propagates NaN/Inf; isfinite is ~50x
        # slower on CPU, so it only runs to count values in a tensor already flagged.
        lo, hi = torch.aminmax(t.reshape(-1))
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            self.nonfinite[key] = self.nonfinite.get(key, 0) + bad


def run_step(fam: Family, group: dict, loader: Reader, selection: dict) -> dict[str, torch.Tensor]:
    """Output slices of one streaming step of `group` (see plan.steps).

    Returns:
        {runtime tensor name: slice}; in experts/rows mode each slice covers
        the step's rows of dim 0, otherwise the whole tensor.
    """
    dtype, scales = group["dtype"], group["scales"]
    rows = selection.get("rows")
    if group["conv"] is None:
        key = next(iter(group["sources"]))
        return {group["first"]: loader.load(key, dtype, scales.get(key), rows)}
    conv = copy.deepcopy(fam.converters[group["conv"]])
    picks = selection.get("experts")
    for pattern, keys in group["sources"].items():
        chosen = [keys[i] for i in picks] if picks is not None else keys
        for key in chosen:
            conv.add_tensor(group["first"], key, pattern,
                            lambda k=key: loader.load(k, dtype, scales.get(k), rows))
    n_rows = len(picks) // group["chunks"] if picks is not None else (rows[1] - rows[0] if rows else None)
    model = SliceShapes(fam.shapes, n_rows) if n_rows is not None else fam.meta
    result = conv.convert(group["first"], model=model, config=fam.config)
    suffix = group.get("suffix", "")  # "_scale_inv" for a group of fused FP8 scales
    out = {n + suffix: (v[0] if isinstance(v, list) else v) for n, v in result.items()}
    # An op may cast to the parameter dtype of the model it is handed (e.g. an unpad op's
    # `.to(model.get_parameter(...).dtype)`); the meta model's is not the planned one.
    target = DTYPES[dtype]
    out = {n: v.to(target) if v.is_floating_point() and v.dtype != target else v
           for n, v in out.items()}
    if set(out) != set(group["targets"]):
        raise RuntimeError(f"converter for {group['first']} produced {sorted(out)}, "
                           f"planned {sorted(group['targets'])}")
    return out


def block_size(config: dict) -> tuple[int, int] | None:
    """`quantization_config.weight_block_size` of a config dict, if any."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config") or {}
    block = quant.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None
