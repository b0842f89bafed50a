"""Tiny checkpoints for the calibrate/compare tests, built once per test session."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

_ROOT = Path(tempfile.mkdtemp(prefix="moeflow-quant-"))
atexit.register(shutil.rmtree, _ROOT, True)  # this process's checkpoints: gone with it


@lru_cache(maxsize=None)
def tiny(family: str, **overrides) -> Path:
    """A tiny random checkpoint of `family` (bf16, real HF layout)."""
    from moeflow_testing.tiny import build_debug_model

    name = family + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    return build_debug_model(family, _ROOT / name, dtype="bfloat16", **overrides)


def edited(src: Path, dst: Path, key: str, fn) -> Path:
    """Copy checkpoint `src` to `dst` with tensor `key` replaced by fn(tensor)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(str(dst / shard))
    tensors[key] = fn(tensors[key].float()).to(tensors[key].dtype).contiguous()
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return dst


def noisy(scale: float = 5.0, seed: int = 0):
    """A damage: W + scale * std(W) * noise (the layer's output is scrambled)."""
    def fn(w: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return w + scale * w.std() * torch.randn(w.shape, generator=gen)
    return fn


def outliers(value: float = 1e4):
    """A weight no 8-bit per-channel scale survives: one huge entry per output row
    (column 0), so every other entry of the row rounds to zero when quantised."""
    def fn(w: torch.Tensor) -> torch.Tensor:
        w = w.clone()
        w[:, 0] = value
        return w
    return fn
