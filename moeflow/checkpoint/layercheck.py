"""Per-layer functional check, for converted models too large to load whole.

For each decoder layer: build that one layer twice on CPU — from the source
checkpoint (its tensors read with `safetensors.safe_open` and converted whole
by the family's transformers converter, FP8 dequantised by transformers' own
`Fp8Dequantize`) and from the converted files — then run both on the same
fixed hidden states and compare outputs. Memory: one layer (one side's at a
time), never the model; tensors are read with `pread` (moeflow.checkpoint.st_io), not
through safetensors' mmap, whose touched pages would count in the process's resident
set. The layer computes in float32, or in the dtype the conversion wrote when a
layer in float32 would exceed the caller's memory budget (`layer_dtype`). The layer
modules come from the family's meta model
(`copy.deepcopy` of the meta layer, then `load_state_dict(assign=True)`), so
they are transformers' own classes.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import torch

from moeflow.checkpoint import fp8, plan
from moeflow.checkpoint.engine import Loader, block_size, run_step
from moeflow.checkpoint.families import Family, load_family
from moeflow.checkpoint.formats import logical_view
from moeflow.checkpoint.parse import read_checkpoint
from moeflow.checkpoint.plan import SCALE_SUFFIX, steps
from moeflow.checkpoint.st_io import DTYPES, TensorInfo, read_header, read_rows, release_heap
from moeflow.core.errors import UserError
from moeflow.model.anatomy import vision_parts


def decoder_layers(meta: torch.nn.Module) -> tuple[str, torch.nn.ModuleList, torch.nn.Module | None]:
    """(state-dict prefix, layers, rotary embedding or None) of a model's text decoder:
    outside the vision parts (DeepSeek-OCR-2's vision encoder is itself a rotary decoder,
    met first), the first `layers` ModuleList whose parent holds a `rotary_emb`, else the
    first `layers` ModuleList (a model whose layers place their own positions, e.g.
    rotary inside the attention: no model-level `rotary_emb`)."""

    vision = vision_parts(meta)
    found = [(name, module) for name, module in meta.named_modules()
             if isinstance(getattr(module, "layers", None), torch.nn.ModuleList)
             and not any(name == v or name.startswith(v + ".") for v in vision)]
    for name, module in found:
        if hasattr(module, "rotary_emb"):
            return (f"{name}.layers" if name else "layers"), module.layers, module.rotary_emb
    for name, module in found:
        return (f"{name}.layers" if name else "layers"), module.layers, None
    raise ValueError(f"{type(meta).__name__}: no decoder `layers` ModuleList")


def _source_state(fam: Family, groups: list[dict], ckpt) -> dict:
    """Runtime tensors of one layer, from the source files by transformers' converters
    (FP8 weights dequantised: the values the layer really computes with)."""

    def read(key: str) -> torch.Tensor:
        return read_rows(ckpt.tensors[key])

    out: dict[str, torch.Tensor] = {}
    for group in groups:
        if _is_scales(group):
            continue  # kept FP8 scales: applied to their weights
        keys = [k for ks in group["sources"].values() for k in ks]
        tensors = {k: _dequantized(read(k), read(s)) if (s := _scale_of(k, ckpt)) else read(k)
                   for k in keys}
        if group["conv"] is None:
            out[group["first"]] = tensors[keys[0]]
            continue
        conv = copy.deepcopy(fam.converters[group["conv"]])
        for pattern, ks in group["sources"].items():
            for k in ks:
                conv.add_tensor(group["first"], k, pattern, lambda k=k: tensors[k])  # noqa: B023  (read in this loop)
        for name, value in conv.convert(group["first"], model=fam.meta, config=fam.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def _source_state_streamed(fam: Family, groups: list[dict], ckpt) -> dict:
    """`_source_state` for a layer whose converter run on whole tensors would not fit the
    budget: each target filled step by step (plan.steps: the converter on a few experts'
    or rows' source slices at a time, moeflow's FP8 dequantisation), so at most one
    step's slices exist beside the layer's output tensors."""
    sources = {k: ckpt.tensors[k] for g in groups for ks in g["sources"].values() for k in ks}
    sources |= {k: ckpt.tensors[k] for g in groups for k in g["scales"].values()}
    loader = Loader(sources, block_size(ckpt.config))  # the source's FP8 blocks
    shapes = {k: v.shape for k, v in sources.items()}
    out: dict[str, torch.Tensor] = {}
    try:
        for group in groups:
            if _is_scales(group):
                continue
            for selection, row0 in steps(group, shapes, plan.ROW_BUDGET // 4):  # as verify's
                for name, t in run_step(fam, group, loader, selection).items():  # [rows, ...]
                    if not t.dim():
                        out[name] = t
                        continue
                    full = out.setdefault(name, torch.empty(group["targets"][name], dtype=t.dtype))
                    full[row0:row0 + t.shape[0]] = t
                release_heap()  # the step's slices (st_io.release_heap)
    finally:
        loader.close()
    return out


def _is_scales(group: dict) -> bool:
    """A group of kept FP8 scales (`--dtype fp8`), not of model parameters."""
    return all(n.endswith("_scale_inv") for n in group["targets"])


def _scale_of(key: str, ckpt) -> str | None:
    scale = key + "_scale_inv"
    return scale if scale in ckpt.tensors else None


def _dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers' reference FP8 block dequantisation (Fp8Dequantize)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    op = Fp8Dequantize.__new__(Fp8Dequantize)  # _dequantize_one needs no quantizer state
    return op._dequantize_one(weight, scale, torch.float32)


def _converted_state(out_dir: Path, names: list[str], config: dict) -> dict:
    """Runtime tensors of one layer from the converted files (FP8 kept: dequantised)."""

    weight_map = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    headers: dict[str, dict[str, TensorInfo]] = {}

    def read(name: str) -> torch.Tensor:
        file = weight_map[name]
        if file not in headers:
            headers[file] = read_header(out_dir / file)[0]
        return read_rows(headers[file][name])

    out = {}
    for name in names:
        t = read(name)
        scale_name = name + SCALE_SUFFIX
        if scale_name in weight_map:
            s = read(scale_name)
            block = block_size(config)
            if block is None:
                raise UserError(f"{out_dir}: tensor {name} has a scale but config.json has no "
                                "quantization_config.weight_block_size")
            t = torch.stack([fp8.dequantize(w, si, block, torch.float32) for w, si in zip(t, s)]) \
                if t.dim() == 3 else fp8.dequantize(t, s, block, torch.float32)  # [E, R, C] / [R, C]
        out[name] = t
    return out


def _build(meta_layer: torch.nn.Module, prefix: str, state: dict, dtype: torch.dtype) -> torch.nn.Module:
    layer = copy.deepcopy(meta_layer).to_empty(device="cpu")
    own = {}
    for k in [k for k in state if k.startswith(prefix)]:
        v = state.pop(k)  # handed over: a cast copy never coexists with its source tensor
        own[k[len(prefix):]] = v.to(dtype) if v.is_floating_point() else v
    missing, unexpected = layer.load_state_dict(own, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{prefix}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return layer.to(dtype).eval()


def layer_dtype(manifest: dict, budget: float | None) -> torch.dtype:
    """What the per-layer check computes in: float32, unless the largest decoder layer in
    float32 (plus the same layer as stored, read before the cast) exceeds `budget` bytes;
    then the float dtype the conversion wrote (its values are the converted ones, so
    both sides still hold the same weights when the conversion is right)."""
    layers: dict[str, list[int]] = {}  # layer -> [elements, stored bytes]
    for name, entry in manifest["tensors"].items():
        m = _LAYER.search(name)
        if m and DTYPES[entry["dtype"]].is_floating_point:
            row = layers.setdefault(m.group(0), [0, 0])
            numel = math.prod(entry["shape"])
            row[0] += numel
            row[1] += numel * DTYPES[entry["dtype"]].itemsize
    need = max((4 * n + b for n, b in layers.values()), default=0)
    if budget is None or need <= budget:
        return torch.float32
    stored = {DTYPES[e["dtype"]] for e in manifest["tensors"].values()
              if DTYPES[e["dtype"]].is_floating_point and DTYPES[e["dtype"]].itemsize >= 2}
    return min(stored, key=lambda d: d.itemsize) if stored else torch.float32


_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


def per_layer_check(src_dir: str | Path, out_dir: str | Path, manifest: dict,
                    tokens: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32,
                    streamed: bool = False) -> dict:
    """Compare every decoder layer built from the source and from the output.

    Args:
        src_dir: the source checkpoint.
        out_dir: the converted directory.
        manifest: its manifest (plan groups name each layer's sources).
        tokens: length of the fixed hidden-state sequence.
        dtype: what the layers compute in (`layer_dtype`).
        streamed: build the source side step by step (`_source_state_streamed`), for a
            layer whose whole-tensor conversion would not fit a budget; not for kept FP8.

    Returns:
        {"layers": n, "max_abs_diff", "worst_layer", "equal": bool,
         "within_tolerance": bool, "per_layer": [diff per layer], "dtype"}.
    """

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    fam = load_family(config)
    prefix, layers, rotary_meta = decoder_layers(fam.meta)
    text_cfg = fam.config.get_text_config()
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, text_cfg.hidden_size, generator=gen).to(dtype)  # [1, T, H]
    position_ids = torch.arange(tokens)[None]  # [1, T]
    extra = {}
    if rotary_meta is not None:  # else the layers place positions themselves
        rotary = type(rotary_meta)(config=rotary_meta.config).float()
        extra["position_embeddings"] = tuple(t.to(dtype) for t in rotary(hidden.float(), position_ids))
    ckpt = read_checkpoint(src_dir)
    streamed = streamed and manifest.get("dtype") != "fp8"  # kept FP8: weights and scales apart
    if streamed:
        ckpt = logical_view(ckpt, fam)  # the engine reads a release format's logical tensors

    def source_state(groups: list[dict]) -> dict:
        return _source_state_streamed(fam, groups, ckpt) if streamed else _source_state(fam, groups, ckpt)

    diffs, scale = [], 0.0
    for i, meta_layer in enumerate(layers):
        lp = f"{prefix}.{i}."
        groups = [g for g in manifest["groups"] if any(n.startswith(lp) for n in g["targets"])]
        names = [n for g in groups for n in g["targets"] if not _is_scales(g)]
        outs = []
        with torch.no_grad():
            # built one after the other: only one side's layer state is alive at a time
            for build in (lambda: source_state(groups),  # noqa: B023
                          lambda: _converted_state(out_dir, names, config)):  # noqa: B023
                state = build()
                layer = _build(meta_layer, lp, state, dtype)
                y = layer(hidden, attention_mask=None, position_ids=position_ids, **extra)
                outs.append((y[0] if isinstance(y, tuple) else y).float())  # [1, T, H]
                del layer, state
                release_heap()
        diffs.append((outs[0] - outs[1]).nan_to_num(0.0).abs().max().item())
        scale = max(scale, outs[0].nan_to_num(0.0).abs().max().item())
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else None
    # values change only by dequantisation or a cast to a narrower dtype (one rounding)
    source = manifest["source_tensors"]
    rounding = manifest.get("dequantized") or any(
        DTYPES[g["dtype"]].itemsize < DTYPES[source[next(iter(g["sources"].values()))[0]]["dtype"]].itemsize
        for g in manifest["groups"])
    top = max(diffs, default=0.0)
    return {"layers": len(diffs), "max_abs_diff": top, "worst_layer": worst, "equal": top == 0.0,
            "within_tolerance": top == 0.0 or (bool(rounding) and top <= 1e-2 * max(scale, 1.0)),
            "per_layer": diffs, "dtype": str(dtype).removeprefix("torch."), "streamed": streamed}
