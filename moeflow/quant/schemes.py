"""Quantisation schemes, in compressed-tensors' own terms.

Each scheme is a compressed-tensors `QuantizationScheme` (weights and input
activations) plus the on-disk format its compressor writes. Quantising one
weight is: scales from the weight's own min/max (`calculate_qparams`), then
the format's compressor (`compress`), so the tensors written are exactly what
compressed-tensors, transformers and vLLM read back.

    fp8        FP8 E4M3 weights per output channel, dynamic per-token FP8
               activations (compressed-tensors FP8_DYNAMIC)
    w8a16      int8 weights per output channel, activations unquantised
    fp8-block  FP8 E4M3 weights in 128x128 blocks, dynamic per-group
               activations (FP8_BLOCK, DeepSeek-V3 style)
    int8       int8 weights per channel, dynamic per-token int8 activations (W8A8)

transformers 5.24 loads fp8 and w8a16 checkpoints natively; it cannot load
fp8-block or int8 on fused experts (block scales are not expanded), so those
are run by moeflow's own dequantising reader (moeflow.quant.source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moeflow.core.errors import UserError

GROUP = "group_0"  # the one config group every moeflow scheme writes


@dataclass(frozen=True)
class Scheme:
    name: str
    preset: str | None  # compressed-tensors preset it equals, if any
    format: str  # compressed-tensors CompressionFormat value
    native: bool  # transformers' from_pretrained runs it (with fused experts)
    bits: int = 8  # weight bits

    def ct_scheme(self, targets: list[str] | None = None):
        """The compressed-tensors QuantizationScheme (targets: module classes / `re:`)."""
        # lazy: compressed_tensors: heavy, loaded only when this runs
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationScheme,
            QuantizationStrategy,
            QuantizationType,
        )
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

        targets = targets or ["Linear"]
        if self.preset:
            return QuantizationScheme(targets=targets, **PRESET_SCHEMES[self.preset])
        # w8a16 per channel (compressed-tensors' W8A16 preset is group-128)
        weights = QuantizationArgs(num_bits=8, type=QuantizationType.INT,
                                   strategy=QuantizationStrategy.CHANNEL, symmetric=True,
                                   dynamic=False)
        return QuantizationScheme(targets=targets, weights=weights)

    @property
    def block(self) -> tuple[int, int] | None:
        structure = self.ct_scheme().weights.block_structure
        return tuple(structure) if structure else None

    @property
    def storage_dtype(self) -> str:
        """The planner's dtype name for the stored weights (moeflow.parallel.memory.DTYPE_BYTES)."""
        return "fp8" if self.name.startswith("fp8") else "int8"

    def bytes_per_weight(self) -> float:
        """Stored bytes per quantised weight element (scales excluded)."""
        return self.bits / 8


SCHEMES: dict[str, Scheme] = {
    "fp8": Scheme("fp8", "FP8_DYNAMIC", "float-quantized", native=True),
    "w8a16": Scheme("w8a16", None, "pack-quantized", native=True),
    "fp8-block": Scheme("fp8-block", "FP8_BLOCK", "float-quantized", native=False),
    "int8": Scheme("int8", "W8A8", "int-quantized", native=False),
}


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise UserError(f"scheme {name!r}: use one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def check_shape(scheme: Scheme, name: str, shape: tuple[int, ...]) -> None:
    """A weight this scheme cannot take (block scheme, dimension not divisible) -> UserError."""
    block = scheme.block
    if block and (shape[-2] % block[0] or shape[-1] % block[1]):
        raise UserError(f"{name}: shape {list(shape)} is not divisible by the {scheme.name} "
                        f"block {block[0]}x{block[1]}; keep it in bf16 (calibrate.ignore) "
                        f"or use scheme fp8")


def quantize_weight(weight: torch.Tensor, scheme: Scheme) -> dict[str, torch.Tensor]:
    """Quantise one [out, in] weight with the scheme's compressor.

    Returns:
        The compressed module state: {"weight" | "weight_packed", "weight_scale",
        ("weight_shape")}, exactly as compressed-tensors stores it.
    """
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    ct = scheme.ct_scheme()
    args = ct.weights
    w = weight.float()  # [O, I]
    block = scheme.block
    if block:
        o, i = w.shape
        tiles = w.reshape(o // block[0], block[0], i // block[1], block[1])  # [O/b, b, I/b, b]
        lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))  # [O/b, I/b]
    else:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)  # [O, 1]
    scale, zero = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    out = compressor.compress(state, ct)
    out.pop("weight_zero_point", None)  # symmetric: compressed-tensors drops it too
    # float32 scales: every reader (transformers' two dequantise paths, vLLM) then
    # dequantises in float32, so moeflow's reader computes exactly what they do
    out["weight_scale"] = out["weight_scale"].float()
    return out


def dequantize_weight(state: dict[str, torch.Tensor], scheme: Scheme,
                      dtype=torch.float32) -> torch.Tensor:
    """Inverse of `quantize_weight` through the same compressor ([out, in] in `dtype`)."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    state = {k: v.float() if k == "weight_scale" else v for k, v in state.items()}
    return compressor.decompress(state, scheme.ct_scheme())["weight"].to(dtype)


def fake_quantize(weight: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """What the quantised model computes with: quantise, then dequantise ([out, in])."""
    return dequantize_weight(quantize_weight(weight, scheme), scheme, weight.dtype)


def quantization_config(scheme: Scheme, ignore: list[str]) -> dict:
    """`quantization_config` for config.json (compressed-tensors' own config model)."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    cfg = QuantizationConfig(config_groups={GROUP: scheme.ct_scheme()}, format=scheme.format,
                             quantization_status=QuantizationStatus.COMPRESSED,
                             ignore=list(ignore))
    return cfg.model_dump(exclude_none=True, mode="json")


def scheme_of_config(config: dict) -> Scheme | None:
    """The moeflow scheme a checkpoint's `quantization_config` was written with (None: not
    quantised). A compressed-tensors config moeflow did not write -> UserError."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "compressed-tensors":
        raise UserError(f"quantization_config.quant_method {qc.get('quant_method')!r}: "
                        f"only compressed-tensors checkpoints are read")
    groups = qc.get("config_groups") or {}
    fmt = qc.get("format")
    for scheme in SCHEMES.values():
        want = scheme.ct_scheme().model_dump(exclude={"targets"}, mode="json", exclude_none=True)
        for group in groups.values():
            got = {k: group.get(k) for k in want}
            if scheme.format == (group.get("format") or fmt) and _same(got, want):
                return scheme
    raise UserError(f"quantization_config: a compressed-tensors scheme moeflow does not read "
                    f"(format {fmt!r}); moeflow reads {', '.join(SCHEMES)}")


def _same(got: dict, want: dict) -> bool:
    def core(args):
        keys = ("num_bits", "type", "strategy", "symmetric", "dynamic", "block_structure", "group_size")
        return None if args is None else {k: args.get(k) for k in keys}
    return all(core(got.get(k)) == core(want.get(k)) for k in ("weights", "input_activations"))


def ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors matching: a module name equal to an entry, or a `re:` entry matching."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry:
            return True
    return False
