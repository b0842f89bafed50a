"""Conversion plan: which source tensors make which runtime tensor, and how.

Source names are renamed exactly as `from_pretrained` does
(`transformers.core_model_loading.rename_source_key` with the family's
renamings and converters). Every runtime tensor gets a *group*: its source
keys (per converter pattern, in transformers' natural order), the converter
(an index into the family's mapping, so plans stay JSON and picklable), the
output tensors with shapes (found by running the converter on `meta`
tensors, then checked against the model), and a streaming *mode*:

- `experts`: the converter stacks per-expert tensors on dim 0 (MergeModulelist,
  ERNIE's text/vision split); it is run one expert (or one expert per chunk)
  at a time and each output slice written at its offset.
- `rows`: one source tensor whose dim 0 survives (renames, transposes of dims
  >= 1): read and converted in row ranges.
- `whole`: anything else; one source group at a time.
"""

from __future__ import annotations

import copy
import re

import torch

from moeflow.checkpoint.engine import block_size
from moeflow.checkpoint.families import Family
from moeflow.checkpoint.parse import Checkpoint, tensor_kind
from moeflow.checkpoint.st_io import DTYPES, TAGS
from moeflow.core.errors import UserError

ROW_BUDGET = 16 << 20  # bytes per row-range read in `rows` mode (keeps peak RSS low)
TARGET_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "keep": None, "fp8": None}
SCALE_SUFFIX = "_scale_inv"  # FP8 block scales: `<weight>_scale_inv`, as transformers names them
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def output_file(name: str) -> str:
    """Output safetensors file of a runtime tensor: one per decoder layer, plus
    embeddings/head, vision tower and projector files."""

    kind = tensor_kind(name)
    if kind in ("vision", "projector"):
        return f"model-{kind}.safetensors"
    m = _LAYER.search(name)
    if m:
        return f"model-layer-{int(m.group(1)):05d}.safetensors"
    return "model-embed-head.safetensors"


def _sliceable(op) -> bool:
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.core_model_loading import (
        Chunk,
        Concatenate,
        ErnieFuseAndSplitTextVisionExperts,
        Interleave,
        MergeModulelist,
        Transpose,
    )

    if isinstance(op, MergeModulelist):
        return op.dim == 0
    if isinstance(op, (Concatenate, Chunk, Interleave)):
        return op.dim >= 1
    if isinstance(op, Transpose):
        return min(op.dim0, op.dim1) >= 1
    if isinstance(op, ErnieFuseAndSplitTextVisionExperts):
        return op.stack_dim == 0 and op.concat_dim >= 1
    return False


def _list_chunks(conv) -> int | None:
    """How many equal chunks a converter cuts each expert list into (None: no list op)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.core_model_loading import ErnieFuseAndSplitTextVisionExperts, MergeModulelist

    ops = conv.operations
    if any(isinstance(op, ErnieFuseAndSplitTextVisionExperts) for op in ops):
        return len(conv.target_patterns)
    if any(isinstance(op, MergeModulelist) for op in ops):
        return 1
    return None


def target_dtype(policy: str, source_dtype: str, scaled: bool) -> str:
    """Safetensors dtype tag of an output tensor under a dtype policy."""
    src = DTYPES[source_dtype]
    if not src.is_floating_point:
        return source_dtype
    want = TARGET_DTYPES.get(policy)
    if want is None:
        if scaled and policy != "fp8":
            raise UserError("--dtype keep cannot keep FP8 block-scaled weights with their scales; "
                            "use bf16 or fp32 (dequantised)")
        return source_dtype
    return TAGS[want]


def plan_conversion(ckpt: Checkpoint, fam: Family, policy: str = "bf16") -> dict:
    """Plan the conversion of `ckpt` to `fam`'s runtime layout.

    Args:
        ckpt: parsed source checkpoint.
        fam: its family (meta model + conversion mapping).
        policy: "bf16", "fp32", "keep" or "fp8" (FP8 block-scaled weights kept
            with their scales, fused like their weights; other tensors kept).

    Returns:
        {"groups": [group dicts], "dropped": [source keys transformers ignores],
         "scales": {weight key: scale key}}. Raises UserError naming the tensor
        for unknown tensors, duplicates, missing tensors and shapes that
        contradict config.json.
    """
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    if policy not in TARGET_DTYPES:
        raise UserError(f"--dtype {policy}: not supported (choose {', '.join(TARGET_DTYPES)})")
    scales = {k[: -len("_scale_inv")]: k for k in ckpt.tensors
              if k.endswith("_scale_inv") and k[: -len("_scale_inv")] in ckpt.tensors}
    pattern_index = {p: i for i, c in enumerate(fam.converters) for p in c.source_patterns}
    groups: dict[str, dict] = {}
    dropped: list[str] = []
    scale_keys = set(scales.values())
    for key in sorted((k for k in ckpt.tensors if k not in scale_keys), key=dot_natural_key):
        renamed, pattern = rename_source_key(key, fam.renamings, fam.converters,
                                             fam.base_model_prefix, fam.meta_state)
        if renamed not in fam.shapes and key in fam.shapes:
            renamed, pattern = key, None
        if renamed not in fam.shapes:
            if fam.ignorable_unexpected(key):
                dropped.append(key)
                continue
            raise UserError(f"{ckpt.tensors[key].file}: tensor {key} is not a tensor of "
                            f"{fam.architecture} (it maps to {renamed})")
        group = groups.setdefault(renamed, {"first": renamed, "conv": None, "sources": {}})
        if pattern is None:
            if group["sources"]:
                other = next(iter(group["sources"]))
                raise UserError(f"{ckpt.tensors[key].file}: tensor {key} listed twice "
                                f"(it and {other} both become {renamed})")
            group["sources"] = {key: [key]}
        else:
            group["conv"] = pattern_index[pattern]
            group["sources"].setdefault(pattern, []).append(key)
    out = [_finish_group(ckpt, fam, g, policy, scales) for g in groups.values()]
    _check_missing(ckpt, fam, out)
    if policy == "fp8":
        out = _keep_fp8(ckpt, fam, out)
    return {"groups": out, "dropped": dropped, "scales": scales}


def _finish_group(ckpt: Checkpoint, fam: Family, group: dict, policy: str,
                  scales: dict[str, str]) -> dict:
    keys = [k for ks in group["sources"].values() for k in ks]
    first_src = ckpt.tensors[keys[0]]
    group["scales"] = {k: scales[k] for k in keys if k in scales}
    group["dtype"] = target_dtype(policy, first_src.dtype, bool(group["scales"]))
    narrow, src = DTYPES[group["dtype"]], DTYPES[first_src.dtype]
    if narrow in (torch.bfloat16, torch.float16) and src == torch.float32 \
            and fam.keeps_fp32(group["first"], narrow):
        group["dtype"] = first_src.dtype  # transformers keeps it in fp32 at this dtype: no cast
    if group["conv"] is None:
        targets = {group["first"]: first_src.shape}
    else:
        targets = _meta_convert(ckpt, fam, group)
    for name, shape in targets.items():
        want = fam.shapes.get(name)
        if want is None or tuple(want) != tuple(shape):
            raise UserError(f"{first_src.file}: tensor {keys[0]} shape {list(first_src.shape)} "
                            f"contradicts config.json: {name} should be "
                            f"{list(want) if want else 'absent'} but the checkpoint gives {list(shape)}")
    group["targets"] = {n: list(s) for n, s in sorted(targets.items())}
    group["file"] = output_file(group["first"])
    group["mode"], group["chunks"] = _mode(ckpt, fam, group)
    return group


def _keep_fp8(ckpt: Checkpoint, fam: Family, groups: list[dict]) -> list[dict]:
    """Policy fp8: scaled groups keep their e4m3 bytes (no dequantisation), and
    each gets a companion group that fuses the scales with the same converter,
    written as `<target>_scale_inv` next to the weight (transformers' FP8Linear /
    FP8Experts parameter names)."""

    block = block_size(ckpt.config)
    out = []
    for group in groups:
        scales, group["scales"] = group["scales"], {}
        group["mode"], group["chunks"] = _mode(ckpt, fam, group)  # no longer dequantised: streamable
        out.append(group)
        if not scales:
            continue
        if block is None:
            key = next(iter(scales))
            raise UserError(f"{ckpt.tensors[key].file}: tensor {key} has {scales[key]} but "
                            "config.json has no quantization_config.weight_block_size")
        out.append(_scale_group(ckpt, fam, group, scales, block))
    return out


def _scale_group(ckpt: Checkpoint, fam: Family, group: dict, scales: dict[str, str],
                 block: tuple[int, int]) -> dict:
    """The group fusing `group`'s block scales; its targets' shapes are checked
    against the block grid of the fused weight."""
    keys = [k for ks in group["sources"].values() for k in ks]
    missing = [k for k in keys if k not in scales]
    if missing:
        raise UserError(f"{ckpt.tensors[missing[0]].file}: tensor {missing[0]} has no "
                        f"{SCALE_SUFFIX} while the tensors fused with it do; cannot keep fp8")
    if group["conv"] is None:
        (key,) = keys
        scale = {"first": group["first"] + SCALE_SUFFIX, "conv": None, "suffix": "",
                 "sources": {scales[key]: [scales[key]]}}
        targets = {scale["first"]: ckpt.tensors[scales[key]].shape}
    else:
        # Fusing scale grids is only exact when every fused dimension is a whole
        # number of blocks (otherwise a block would straddle two experts/projections).
        for k in keys:
            shape = ckpt.tensors[k].shape
            if len(shape) != 2 or shape[0] % block[0] or shape[1] % block[1]:
                raise UserError(f"{ckpt.tensors[k].file}: tensor {k} shape {list(shape)} is not a whole "
                                f"number of {list(block)} blocks; cannot fuse its scales (use --dtype bf16)")
        scale = {"first": group["first"], "conv": group["conv"], "suffix": SCALE_SUFFIX,
                 "sources": {p: [scales[k] for k in ks] for p, ks in group["sources"].items()}}
        targets = {n + SCALE_SUFFIX: s for n, s in _meta_convert(ckpt, fam, scale).items()}
    for name, shape in targets.items():
        weight = group["targets"][name[: -len(SCALE_SUFFIX)]]
        want = [*weight[:-2], -(-weight[-2] // block[0]), -(-weight[-1] // block[1])]
        if list(shape) != want:
            key = next(iter(scale["sources"].values()))[0]
            raise UserError(f"{ckpt.tensors[key].file}: tensor {key} gives {name} of shape "
                            f"{list(shape)}, but the block grid of its weight is {want}")
    first_src = ckpt.tensors[next(iter(scale["sources"].values()))[0]]
    scale.update(scales={}, dtype=first_src.dtype, targets={n: list(s) for n, s in sorted(targets.items())},
                 file=group["file"])
    scale["mode"], scale["chunks"] = _mode(ckpt, fam, scale)
    return scale


def _meta_convert(ckpt: Checkpoint, fam: Family, group: dict) -> dict[str, tuple]:
    conv = copy.deepcopy(fam.converters[group["conv"]])
    for pattern, keys in group["sources"].items():
        for key in keys:
            shape = ckpt.tensors[key].shape
            conv.add_tensor(group["first"], key, pattern,
                            lambda s=shape: torch.empty(s, dtype=torch.float32, device="meta"))
    try:
        result = conv.convert(group["first"], model=fam.meta, config=fam.config)
    except Exception as e:  # transformers raises plain errors for inconsistent groups
        key = next(iter(group["sources"].values()))[0]
        raise UserError(f"{ckpt.tensors[key].file}: tensor {key}: cannot build {group['first']} "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "shapes contradict config.json or experts are missing") from None
    return {n: tuple((v[0] if isinstance(v, list) else v).shape) for n, v in result.items()}


def _mode(ckpt: Checkpoint, fam: Family, group: dict) -> tuple[str, int]:
    keys = [k for ks in group["sources"].values() for k in ks]
    if group["conv"] is None:
        src = ckpt.tensors[keys[0]]
        scaled = bool(group["scales"]) or not src.shape or not getattr(src, "rowable", True)
        return ("whole" if scaled else "rows"), 1
    conv = fam.converters[group["conv"]]
    if not all(_sliceable(op) for op in conv.operations) or group["scales"] and len(keys) == 1:
        return "whole", 1
    chunks = _list_chunks(conv)
    dims0 = {s[0] for s in group["targets"].values() if s}
    if chunks is not None:
        lengths = {len(v) for v in group["sources"].values()}
        n = lengths.pop() if len(lengths) == 1 else -1
        if n > 0 and n % chunks == 0 and dims0 == {n // chunks}:
            return "experts", chunks
        return "whole", 1
    if len(keys) == 1 and len(ckpt.tensors[keys[0]].shape) >= 3 \
            and dims0 == {ckpt.tensors[keys[0]].shape[0]}:
        return "rows", 1
    return "whole", 1


def _check_missing(ckpt: Checkpoint, fam: Family, groups: list[dict]) -> None:
    produced = {n for g in groups for n in g["targets"]}
    missing = sorted(set(fam.shapes) - produced - fam.optional_keys())
    if missing:
        raise UserError(f"{ckpt.path}: checkpoint lacks tensor {missing[0]} of {fam.architecture}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def steps(group: dict, src_shapes: dict[str, tuple], budget: int | None = None) -> list[tuple[dict, int]]:
    """Streaming steps of a group: (selection, first output row of the step).

    A selection is {"experts": [list positions]} (experts mode), {"rows": (a, b)}
    (rows mode) or {} (whole). `budget`: source bytes (as float32) per step (None: ROW_BUDGET).
    """
    budget = ROW_BUDGET if budget is None else budget
    mode = group["mode"]
    if mode == "experts":
        n = len(next(iter(group["sources"].values())))
        per = n // group["chunks"]
        # several experts per step (up to ROW_BUDGET of source data): fewer converter
        # runs and queued writes per byte; memory stays bounded by the budget
        one = sum(_numel(src_shapes[ks[0]]) * 4 for ks in group["sources"].values()) * group["chunks"]
        k = max(1, min(per, budget // max(1, one)))
        return [({"experts": [i + j * per for j in range(group["chunks"])
                              for i in range(e, min(e + k, per))]}, e) for e in range(0, per, k)]
    if mode == "rows":
        key = next(iter(group["sources"].values()))[0]
        shape = src_shapes[key]
        row_bytes = max(1, _numel(shape[1:]) * 4)
        step = max(1, budget // row_bytes)
        return [({"rows": (a, min(a + step, shape[0]))}, a) for a in range(0, shape[0], step)]
    return [({}, 0)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
