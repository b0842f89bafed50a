"""Release formats: weights stored quantised on disk, read as the tensors they stand for.

A release may store a weight as several tensors (packed codes plus scales). This
module finds them from the checkpoint's names, shapes and `quantization_config`,
and presents each as one *logical* tensor (`Packed`): the name and shape the
unquantised checkpoint would have, float32, plus the stored parts it is decoded
from. The conversion plan then treats it like any other source tensor; the
engine's loader decodes it (`read`) one tensor, or one expert range, at a time.

Formats, each decoded by the format's own reference implementation:

    mxfp4                 `<w>_blocks` / `<w>_scales` (GPT-OSS layout; mxfp4.py,
                          transformers' dequantiser)
    pack-quantized        compressed-tensors INT1..8 packed in int32 (group/channel,
                          symmetric/asymmetric: `weight_packed`, `weight_scale`,
                          `weight_shape`, `weight_zero_point`)
    nvfp4-pack-quantized  compressed-tensors NVFP4 (`weight_packed` uint8, e4m3
                          `weight_scale`, `weight_global_scale`)
    mxfp4-pack-quantized  compressed-tensors MXFP4
    float-quantized       compressed-tensors FP8 (`weight` e4m3 + `weight_scale`,
                          tensor / channel / block)
    int-quantized, naive-quantized: compressed-tensors INT8 stored unpacked

compressed-tensors weights are matched to their config group as its model-free
dequantiser does (`match_quantizable_tensors`) and decoded by the group's
compressor (`decompress`). DeepSeek-style FP8 blocks (`weight_scale_inv`) stay
with fp8.py and the plan's scale groups.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from functools import cached_property

import pydantic
import torch

from moeflow.checkpoint import mxfp4
from moeflow.checkpoint.parse import Checkpoint, tensor_kind
from moeflow.checkpoint.st_io import TensorInfo, read_rows
from moeflow.core.errors import UserError

LOGICAL_DTYPE = "F32"  # decoded values are exact in float32, then cast once
# stored beside quantised weights, used by no unquantised model (activation / kv-cache scales)
_QPARAM_LEAVES = ("input_scale", "input_global_scale", "input_zero_point", "output_scale",
                  "k_scale", "v_scale", "q_scale")


@dataclass(frozen=True)
class Packed(TensorInfo):
    """A logical tensor decoded from stored parts (`name`, `shape`: as unquantised;
    `file`/`start`/`end`: its first part's)."""

    format: str = ""
    parts: tuple = ()  # ((role, TensorInfo), ...)
    scheme: str = ""  # compressed-tensors QuantizationScheme JSON ("" for mxfp4)
    transpose: bool = False  # mxfp4: the model holds [*lead, in, out]
    in_features: int = 0  # mxfp4: the real input width (0: G * 32)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p in self.parts)

    @cached_property
    def part(self) -> dict[str, TensorInfo]:
        return dict(self.parts)

    @property
    def rowable(self) -> bool:
        """Dim-0 row ranges of the logical tensor are row ranges of every part."""
        return self.format == "mxfp4" and (len(self.shape) >= 3 or not self.transpose)


def find_packed(ckpt) -> tuple[dict[str, Packed], list[str]]:
    """Logical tensors of a checkpoint's quantised weights, before any model is known.

    Returns:
        ({logical name: Packed}, [stored keys dropped: activation / kv-cache scales]).
        The parts of every Packed are no longer source tensors of their own.
    """
    qc = ckpt.config.get("quantization_config") or (ckpt.config.get("text_config") or {}).get(
        "quantization_config") or {}
    found = _mxfp4_pairs(ckpt)
    dropped: list[str] = []
    if qc.get("quant_method") == "compressed-tensors":
        found.update(_compressed_tensors(ckpt, qc))
        dropped = [k for k in ckpt.tensors if k.rpartition(".")[2] in _QPARAM_LEAVES]
    return found, dropped


def logical_view(ckpt, fam=None):
    """`ckpt` with packed parts replaced by their logical tensors (a new Checkpoint).

    Args:
        fam: the family (moeflow.checkpoint.families); when given, MXFP4 weights
            take the orientation and input width of the model's tensor.
    """
    packed, dropped = find_packed(ckpt)
    if not packed and not dropped:
        return ckpt
    used = {p.name for t in packed.values() for _, p in t.parts} | set(dropped)
    tensors = {k: v for k, v in ckpt.tensors.items() if k not in used}
    for name, t in packed.items():
        tensors[name] = _orient(t, fam) if fam is not None and t.format == "mxfp4" else t
    return Checkpoint(ckpt.path, ckpt.config, tensors, ckpt.shards, ckpt.aux_files)


def read(info: Packed, rows: tuple[int, int] | None = None, fd=None, source=None) -> torch.Tensor:
    """Decode a logical tensor (or rows [a, b) of dim 0 when `info.rowable`) to float32.

    Args:
        fd: fd(path) -> an open descriptor to read parts with (else each is opened).
        source: source(part TensorInfo) -> the part as stored, already in memory.
    """
    def part(role: str, sliced: bool = True) -> torch.Tensor:
        p = info.part[role]
        if source is not None:
            t = source(p)
            return t[rows[0]:rows[1]] if rows and sliced else t
        f = fd(p.file) if fd else None
        return read_rows(p, *rows, fd=f) if rows and sliced else read_rows(p, fd=f)

    if rows and not info.rowable:
        raise ValueError(f"{info.name}: {info.format} cannot be read in row ranges")
    if info.format == "mxfp4":
        w = mxfp4.decode(part("blocks"), part("scales"), dtype=torch.float32,
                         in_features=info.in_features or None, name=info.name)
        return w.transpose(-1, -2).contiguous() if info.transpose else w
    return _ct_decode(info, {role: part(role, False) for role in info.part})


# --- MXFP4 -----------------------------------------------------------------------------

def _mxfp4_pairs(ckpt) -> dict[str, Packed]:
    out = {}
    for key, blocks in ckpt.tensors.items():
        if not key.endswith("_blocks"):
            continue
        name = key[: -len("_blocks")]
        scales = ckpt.tensors.get(name + "_scales")
        if scales is None:
            raise UserError(f"{blocks.file}: tensor {key} has no {name}_scales (an MXFP4 weight "
                            "needs both)")
        try:
            mxfp4.check(blocks.shape, scales.shape, name, blocks.dtype, scales.dtype)
        except UserError as e:
            raise UserError(f"{blocks.file}: {e}") from None
        out[name] = Packed(name, blocks.file, LOGICAL_DTYPE, mxfp4.decoded_shape(blocks.shape),
                           blocks.start, blocks.end, format="mxfp4",
                           parts=(("blocks", blocks), ("scales", scales)))
    return out


def _orient(t: Packed, fam) -> Packed:
    """Match an MXFP4 weight ([*lead, out, G*32] decoded) to the model's tensor: transposed
    when the model holds [*lead, in, out] (experts with `is_transposed`, GPT-OSS), the
    input width cut to the model's (widths that are not a multiple of 32)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.core_model_loading import rename_source_key

    renamed, _ = rename_source_key(t.name, fam.renamings, fam.converters, fam.base_model_prefix,
                                   fam.meta_state)
    want = fam.shapes.get(renamed) or fam.shapes.get(t.name)
    if want is None:
        return t  # not a tensor of the model: the plan refuses it, naming it
    *lead, out, padded = t.shape
    flag = _transposed_flag(fam.meta, renamed)
    straight = len(want) == len(t.shape) and tuple(want[:-1]) == (*lead, out) \
        and padded - mxfp4.BLOCK < want[-1] <= padded
    turned = len(want) == len(t.shape) and tuple(want[:-2]) == tuple(lead) and want[-1] == out \
        and padded - mxfp4.BLOCK < want[-2] <= padded
    if flag is None and straight and turned:
        raise UserError(f"{t.file}: tensor {t.name}_blocks: the model's {renamed} {list(want)} is "
                        "square and its module does not say whether it is stored transposed")
    transpose = bool(flag) if flag is not None and (straight or turned) else turned and not straight
    if not (turned if transpose else straight):
        raise UserError(f"{t.file}: tensor {t.name}_blocks {list(t.part['blocks'].shape)} cannot "
                        f"hold the model's {renamed} {list(want)} (MXFP4 [*lead, out, G, 16])")
    width = want[-2] if transpose else want[-1]
    shape = (*lead, width, out) if transpose else (*lead, out, width)
    return dataclasses.replace(t, shape=tuple(shape), transpose=transpose,
                               in_features=width if width != padded else 0)


def _transposed_flag(meta, param: str) -> bool | None:
    """`is_transposed` of the module holding `param` (transformers' experts decorator)."""
    owner, _, _ = param.rpartition(".")
    try:
        module = meta.get_submodule(owner)
    except AttributeError:
        return None
    flag = getattr(module, "is_transposed", None)
    return flag if isinstance(flag, bool) else None


# --- compressed-tensors ----------------------------------------------------------------

def _ct_config(ckpt, qc: dict):
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.quantization import QuantizationConfig

    try:
        return QuantizationConfig.model_validate(qc)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        raise UserError(f"{ckpt.path / 'config.json'}: quantization_config."
                        f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def _ct_format(cfg, scheme) -> str:
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.compressors.format import infer_module_format

    fmt = scheme.format or cfg.format
    if fmt in (None, "mixed-precision"):
        fmt = infer_module_format(torch.nn.Linear, scheme)
    return fmt.value if hasattr(fmt, "value") else str(fmt)


def _compressed_tensors(ckpt, qc: dict) -> dict[str, Packed]:
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.utils.match import match_quantizable_tensors

    cfg = _ct_config(ckpt, qc)
    names = dict.fromkeys(ckpt.tensors)
    out: dict[str, Packed] = {}
    for scheme in cfg.config_groups.values():
        if isinstance(scheme, list) or scheme.weights is None:
            continue
        fmt = _ct_format(cfg, scheme)
        if fmt == "dense":
            continue
        try:
            compressor = BaseCompressor.get_value_from_registry(fmt)
            params = compressor.compression_param_names(scheme)
        except (KeyError, ValueError, NotImplementedError):
            raise UserError(f"{ckpt.path / 'config.json'}: compressed-tensors format {fmt!r} "
                            "is not one moeflow reads") from None
        params = tuple(p for p in params if p not in _QPARAM_LEAVES)
        for module, root in match_quantizable_tensors(names, cfg.ignore or [], scheme.targets,
                                                      param_targets=[params[0]]):
            name = f"{module}.weight"
            if name in out:
                continue  # an earlier config group took it (compressed-tensors' order)
            missing = [p for p in params if f"{module}.{p}" not in ckpt.tensors]
            if params[0] == "weight" and len(missing) == len(params) - 1:
                continue  # a plain weight the name match also takes (embeddings, an ignored head)
            if missing:
                raise UserError(f"{ckpt.tensors[root].file}: tensor {root} ({fmt}) has no "
                                f"{module}.{missing[0]}")
            parts = tuple((p, ckpt.tensors[f"{module}.{p}"]) for p in params)
            out[name] = _ct_packed(name, fmt, dict(parts), parts, scheme)
    return out


def _ct_packed(name: str, fmt: str, part: dict, parts: tuple, scheme) -> Packed:
    first = parts[0][1]
    if "weight_shape" in part:
        shape = tuple(int(d) for d in read_rows(part["weight_shape"]).reshape(-1))
    elif fmt.endswith("fp4-pack-quantized"):
        shape = (*first.shape[:-1], first.shape[-1] * 2)
    else:
        shape = first.shape
    return Packed(name, first.file, LOGICAL_DTYPE, tuple(shape), first.start, first.end,
                  format=fmt, parts=parts,
                  scheme=json.dumps(scheme.model_dump(mode="json", exclude_none=True), sort_keys=True))


def _ct_decode(info: Packed, state: dict[str, torch.Tensor]) -> torch.Tensor:
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(json.loads(info.scheme))
    compressor = BaseCompressor.get_value_from_registry(info.format)
    try:
        w = compressor.decompress(state, scheme)["weight"]
    except Exception as e:  # the library raises plain errors on inconsistent parts
        raise UserError(f"{info.file}: tensor {info.name} ({info.format}): cannot decode "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if tuple(w.shape) != tuple(info.shape):
        raise UserError(f"{info.file}: tensor {info.name} ({info.format}) decodes to "
                        f"{list(w.shape)}, its stored shape says {list(info.shape)}")
    return w.float()


def reference_dequantized(src, out, dtype=torch.bfloat16):
    """Write `src` (a compressed-tensors release small enough to hold in memory) to `out`
    dequantised by compressed-tensors' own model-free dequantiser
    (`CompressedTensorsDequantizer`), config.json without its quantization_config.
    The reference convert's output is checked against."""

    # lazy: compressed_tensors, safetensors: heavy, loaded only when this runs
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file, save_file

    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    # float-quantized keeps `weight` as its root name, which the name match also finds on
    # unquantised modules (embeddings, norms): they are ignored by name, as a model would
    plain = [k[: -len(".weight")] for k in tensors
             if k.endswith(".weight") and k[: -len("weight")] + "weight_scale" not in tensors]
    dense = CompressedTensorsDequantizer(str(src), ignore=plain, dtype=dtype).process(tensors)
    dense = {k: v for k, v in dense.items() if k.rpartition(".")[2] not in _QPARAM_LEAVES}
    save_file({k: v.contiguous() for k, v in dense.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".json")) or f.name.startswith(
                ("tokenizer", "generation")):
            shutil.copy2(f, out / f.name)
    return out


def summary(ckpt) -> dict[str, dict]:
    """{format: {"tensors", "bytes", "kinds"}} of a checkpoint's stored weights, for inspect:
    release formats by name (mxfp4, pack-quantized, fp8-block, ...), plain tensors by dtype."""
    packed, dropped = find_packed(ckpt)
    used = {p.name for t in packed.values() for _, p in t.parts} | set(dropped)
    rows: dict[str, dict] = {}

    def add(fmt: str, name: str, nbytes: int) -> None:
        row = rows.setdefault(fmt, {"tensors": 0, "bytes": 0, "kinds": []})
        row["tensors"] += 1
        row["bytes"] += nbytes
        if tensor_kind(name) not in row["kinds"]:
            row["kinds"].append(tensor_kind(name))

    for name, t in packed.items():
        add(t.format, name, t.nbytes)
    scale_inv = {k[: -len("_scale_inv")] for k in ckpt.tensors if k.endswith("_scale_inv")}
    for name, info in ckpt.tensors.items():
        if name in used or name.endswith("_scale_inv"):
            continue
        add("fp8-block" if name in scale_inv else info.dtype.lower(), name, info.nbytes)
    return {k: dict(v, kinds=sorted(v["kinds"])) for k, v in sorted(rows.items())}
