"""Tiny releases in the real on-disk layouts of quantised MoE releases (for tests and
benchmarks; nothing here is a checkpoint we ship).

Each takes a bf16 debug model (moeflow_testing.tiny) and rewrites its shards the way the
format's producer writes them:

- `mxfp4_release`: every fused routed-expert tensor becomes `<w>_blocks` / `<w>_scales`
  in GPT-OSS's layout ([E, out, G, 16] / [E, out, G]; `quant_method: mxfp4`),
  encoded by moeflow.checkpoint.mxfp4 (transformers' encoder needs GPU kernels).
- `ct_release`: every decoder linear weight (per-expert ones included, as Kimi-K2
  ships them; routers, norms, embeddings and head stay bf16) compressed by
  compressed-tensors' own compressor for a scheme of `SCHEMES`, with scales from
  its own `calculate_qparams`, and its `QuantizationConfig` in config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.formats import _transposed_flag
from moeflow.checkpoint.mxfp4 import encode
from moeflow.checkpoint.requant import qparams
from moeflow.model.anatomy import classify

INDEX = "model.safetensors.index.json"


def _rewrite(src: Path, out: Path, fn, quantization_config: dict) -> Path:
    """Copy `src` to `out`, passing every shard's tensors through fn(name, tensor) -> {name: t}."""
    # lazy: safetensors: heavy, loaded only when this runs
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    index = json.loads((tmp / INDEX).read_text()) if (tmp / INDEX).is_file() else None
    weight_map = {}
    for shard in sorted(tmp.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(str(shard)).items():
            for new, value in fn(name, t).items():
                tensors[new] = value.contiguous()
                weight_map[new] = shard.name
        save_file(tensors, str(shard), metadata={"format": "pt"})
    if index is not None:  # a single model.safetensors has none
        index["weight_map"] = dict(sorted(weight_map.items()))
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _expert_orientation(src: Path) -> dict[str, bool]:
    """{runtime name of each fused 3-D routed-expert tensor: stored [E, in, out]?}."""

    fam = load_family(json.loads((Path(src) / "config.json").read_text()))
    out = {}
    for p in classify(fam.meta, fam.config).params:
        if p.kind == "experts" and len(p.shape) == 3:
            out[p.name] = bool(_transposed_flag(fam.meta, p.name))
    return out


def mxfp4_release(src: str | Path, out: str | Path) -> Path:
    """`src` (a bf16 model whose experts are fused on disk, e.g. GPT-OSS) with MXFP4 experts."""
    experts = _expert_orientation(Path(src))

    def fn(name: str, t: torch.Tensor) -> dict:
        if name not in experts:
            return {name: t}

        w = t.transpose(1, 2) if experts[name] else t  # the format's [E, out, in]
        blocks, scales = encode(w)
        return {name + "_blocks": blocks, name + "_scales": scales}

    qc = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return _rewrite(Path(src), Path(out), fn, qc)


def _args(**kw):
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**kw)


def scheme(name: str):
    """The compressed-tensors QuantizationScheme of one of `SCHEMES` (targets: Linear)."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.quantization import QuantizationScheme

    fp8 = dict(num_bits=8, type="float", symmetric=True, dynamic=False)
    weights = {
        "int4-group": _args(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True),
        "int4-group-asym": _args(num_bits=4, type="int", strategy="group", group_size=32,
                                 symmetric=False),
        "int8-channel": _args(num_bits=8, type="int", strategy="channel", symmetric=True),
        "int4-channel-asym": _args(num_bits=4, type="int", strategy="channel", symmetric=False),
        "nvfp4": _args(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                       symmetric=True, dynamic=False, scale_dtype=torch.float8_e4m3fn,
                       zp_dtype=torch.float8_e4m3fn),
        "mxfp4": _args(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                       dynamic=False, scale_dtype=torch.uint8, zp_dtype=torch.uint8),
        "fp8-tensor": _args(strategy="tensor", **fp8),
        "fp8-channel": _args(strategy="channel", **fp8),
        "fp8-block": _args(strategy="block", block_structure=[16, 16], **fp8),
    }[name]
    acts = None
    if name.startswith("fp8"):  # float-quantized is W8A8 FP8: dynamic per-token activations
        acts = _args(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


SCHEMES = ("int4-group", "int4-group-asym", "int8-channel", "int4-channel-asym", "nvfp4", "mxfp4",
           "fp8-tensor", "fp8-channel", "fp8-block")


def _qparams(w: torch.Tensor, args) -> dict:
    """Scale (and zero point, global scale) of one [out, in] weight, by compressed-tensors
    (moeflow.checkpoint.requant: what a merge requantises with too)."""
    return qparams(w, args)


def _quantized(name: str, t: torch.Tensor) -> bool:
    # decoder linear projections (per-expert ones included); not routers, norms, embeddings, head
    return ".layers." in name and name.endswith("_proj.weight") and t.dim() == 2


def ct_release(src: str | Path, out: str | Path, name: str, experts_only: bool = False) -> Path:
    """`src` (bf16) as a compressed-tensors release of scheme `name` (one of SCHEMES);
    `experts_only`: the routed experts quantised, attention and the rest kept in their
    precision (as large MoE releases ship, e.g. INT4 experts beside BF16 attention)."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    sch = scheme(name)
    fmt = infer_module_format(torch.nn.Linear, sch)
    compressor = BaseCompressor.get_value_from_registry(fmt.value)

    def fn(key: str, t: torch.Tensor) -> dict:
        if not _quantized(key, t) or (experts_only and ".experts." not in key):
            return {key: t}
        module = key[: -len(".weight")]
        state = {"weight": t.float(), **_qparams(t.float(), sch.weights)}
        packed = compressor.compress(state, sch)
        if sch.weights.symmetric:
            packed.pop("weight_zero_point", None)
        return {f"{module}.{k}": v for k, v in packed.items()}

    cfg = QuantizationConfig(config_groups={"group_0": sch}, format=fmt.value,
                             quantization_status=QuantizationStatus.COMPRESSED,
                             ignore=["lm_head", "re:.*mlp.gate$"]
                             + (["re:^(?!.*\\.experts\\.).*"] if experts_only else []))
    return _rewrite(Path(src), Path(out), fn, cfg.model_dump(exclude_none=True, mode="json"))
