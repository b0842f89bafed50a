"""A weight changed in float32 (a merged LoRA delta) quantised back into its release format.

    parts, stats = requantize(info, merged)

`info` is the release's logical tensor (moeflow.checkpoint.formats.Packed), `merged` its
new float32 values; `parts` are the new stored tensors under the release's own names,
dtypes and shapes, `stats` the error of the requantised weight against `merged`:

    rel_rms          ||decode(parts) - merged|| / ||merged||
    max_abs          max |decode(parts) - merged|
    max_over_bound   max of |error| / the format's per-value bound (below); <= 1 holds
    within_bound     max_over_bound <= 1

Formats: MXFP4 in GPT-OSS's layout (moeflow.checkpoint.mxfp4's encoder), DeepSeek-style
FP8 blocks (`weight` e4m3 + float32 `weight_scale_inv` per `weight_block_size` tile, as
`convert --dtype fp8` keeps them: `fp8_blocks`, moeflow.checkpoint.fp8's quantiser, since
compressed-tensors has none for this layout) and every
compressed-tensors format whose compressor can compress (pack-quantized INT4/INT8,
nvfp4-pack-quantized, mxfp4-pack-quantized, float-quantized FP8 per tensor / channel /
block, int-quantized), with scales and zero points from compressed-tensors' own
`calculate_qparams` over the format's groups and the codes from the compressor's own
`compress`: what the release's producer (llm-compressor) runs. The group min/max those
take is computed here: compressed-tensors computes it inside its observers, which need
a module and a calibration loop, not a tensor.

Per-value bounds, as a fraction c of the amax of the value's quantisation group g
(group, block, channel or tensor, by the scheme's strategy), u the relative precision
of the stored scale's dtype (float32: 2^-24, bf16: 2^-8):

    INT b bits      round to nearest on a grid of scale s = amax_g / ((2^b - 1) / 2)
                    (symmetric) or range_g / (2^b - 1) <= 2 amax_g / (2^b - 1)
                    (asymmetric): |err| <= s / 2, plus what the scale's rounding clips at
                    the grid's end: c = (1 + 2^b u) / (2^b - 1)  (INT4: 1/15)
    FP8 e4m3        (compressed-tensors and `weight_scale_inv` blocks alike)
                    s = amax_g / 448, no value saturates; e4m3 keeps 3 mantissa bits, so
                    a normal value moves by at most 2^-4 of itself (subnormals by 2^-10 s):
                    c = 2^-4 + u
    NVFP4           s = fp8(amax_g / 6) (over the tensor's global scale); E2M1's largest
                    step is 4 -> 6, so |err| <= s, and s is amax_g / 6 rounded by at most
                    2^-4 of itself (e4m3): c = (1 + 2^-4) / 6, plus 6 * 2^-9 / global
                    scale where the group's scale is an e4m3 subnormal
    MXFP4           s = 2^e, e from amax_g rounded to E2M1's one mantissa bit
                    (compressed-tensors' `generate_mx_scales`), so amax_g / s lies in
                    [3.5, 7): E2M1's last step 4 -> 6 and saturation at 6 move a value by
                    <= s <= amax_g / 3.5: c = 2/7
    MXFP4, GPT-OSS  moeflow's encoder (OCP MX: e = floor(log2 amax_g) - 2, amax_g / 2^e in
                    [4, 8)): saturation at 6 moves a value by up to 2 x 2^e, the bound

Each bound also takes the rounding of the dtype the format's decoder returns (amax_g times
half its epsilon: compressed-tensors decodes NVFP4 to bf16, 2^-9), since that decoded
value is what a model computes with.

A stored weight whose delta is exactly zero is never requantised (the caller copies its
bytes): requantising a decoded weight need not give back the release's scales.
"""

from __future__ import annotations

import json

import torch

from moeflow.checkpoint import fp8, mxfp4
from moeflow.checkpoint.st_io import DTYPES
from moeflow.core.errors import UserError

_STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block")


def _args_of(info):
    """The weight QuantizationArgs of a compressed-tensors logical tensor."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme.model_validate(json.loads(info.scheme))


def _strategy(args) -> str:
    return args.strategy.value if hasattr(args.strategy, "value") else str(args.strategy)


def unsupported(info) -> str | None:
    """Why the weight `info` (a Packed) cannot be requantised here, or None."""
    if info.format == "mxfp4":
        return None
    if not info.scheme:
        return f"format {info.format} has no requantiser"
    args = _args_of(info).weights
    strategy = _strategy(args)
    if strategy not in _STRATEGIES:
        return f"{info.format} with strategy {strategy}"
    if len(info.shape) != 2:
        return f"{info.format} of a {len(info.shape)}-D tensor"
    if any(role.endswith("g_idx") for role, _ in info.parts):
        return f"{info.format} with activation ordering (g_idx)"
    if args.type == "float" and args.num_bits not in (4, 8) or args.type not in ("int", "float"):
        return f"{info.format} {args.type}{args.num_bits}"
    try:
        _tiles(torch.empty(info.shape, device="meta"), args)
    except ValueError as e:
        return str(e)
    return None


def _tiles(w: torch.Tensor, args) -> tuple[torch.Tensor, tuple]:
    """`w` [O, I] viewed as its quantisation groups, and the dims each group spans."""
    o, i = w.shape
    strategy = _strategy(args)
    if strategy in ("group", "tensor_group"):
        if i % args.group_size:
            raise ValueError(f"input width {i} not a multiple of group size {args.group_size}")
        return w.reshape(o, i // args.group_size, args.group_size), (-1,)  # [O, I/g, g]
    if strategy == "block":
        b0, b1 = args.block_structure
        if o % b0 or i % b1:
            raise ValueError(f"shape {[o, i]} not a whole number of {[b0, b1]} blocks")
        return w.reshape(o // b0, b0, i // b1, b1), (1, 3)  # [O/b0, b0, I/b1, b1]
    if strategy == "channel":
        return w, (1,)
    return w.reshape(1, -1), (1,)  # tensor


def qparams(w: torch.Tensor, args, scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Scale (zero point, global scale) of one [O, I] weight, by compressed-tensors'
    `calculate_qparams` over the scheme's groups; the scale rounded to `scale_dtype`
    (the release's stored dtype) before any code is computed from it."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    tiles, dims = _tiles(w, args)
    keep = _strategy(args) in ("channel", "tensor")
    lo, hi = tiles.amin(dim=dims, keepdim=keep), tiles.amax(dim=dims, keepdim=keep)
    state: dict = {}
    if _strategy(args) == "tensor_group":
        state["weight_global_scale"] = generate_gparam(w.amin(), w.amax()).reshape(1)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=state.get("weight_global_scale"))
    if scale_dtype is not None and scale_dtype.is_floating_point and scale.dtype != scale_dtype:
        # the value the release stores (bf16, e4m3), kept in the dtype compressed-tensors
        # computes in; E8M0 exponents (uint8) are rounded by compressed-tensors itself
        scale = scale.to(scale_dtype).to(scale.dtype)
    if _strategy(args) == "tensor":
        scale, zero = scale.reshape(1), zero.reshape(1)
    state.update(weight_scale=scale, weight_zero_point=zero)
    return state


def _group_amax(w: torch.Tensor, args) -> torch.Tensor:
    """|w|'s amax over each value's quantisation group, broadcast to [O, I]."""
    tiles, dims = _tiles(w.abs(), args)
    return tiles.amax(dim=dims, keepdim=True).expand_as(tiles).reshape(w.shape)


def _bound(w: torch.Tensor, args, state: dict[str, torch.Tensor], decoded: torch.dtype) -> torch.Tensor:
    """Largest |requantised - w| the format allows at each value (module docstring), plus
    the rounding of the compressor's output dtype `decoded` (NVFP4 decodes to bf16)."""
    amax = _group_amax(w, args)
    return _format_bound(w, args, state, amax) + amax * torch.finfo(decoded).eps / 2


def _format_bound(w: torch.Tensor, args, state: dict[str, torch.Tensor], amax: torch.Tensor) -> torch.Tensor:
    scale = state["weight_scale"]
    if args.type == "int":
        u = torch.finfo(scale.dtype).eps if scale.dtype.is_floating_point else 0.0
        n = 2 ** args.num_bits
        return amax * (1 + n * u) / (n - 1)
    if args.num_bits == 8:
        return amax * (2.0 ** -4 + torch.finfo(scale.dtype).eps)
    if args.scale_dtype == torch.uint8:  # E8M0 power-of-two scales: MXFP4
        return amax * 2 / 7
    floor = 6 * 2.0 ** -9 / state["weight_global_scale"].float() if "weight_global_scale" in state \
        else torch.zeros(())
    return amax * (1 + 2.0 ** -4) / 6 + floor


def _stats(err: torch.Tensor, merged: torch.Tensor, bound: torch.Tensor, name: str) -> dict:
    over = float((err / bound.clamp(min=1e-30)).max()) if err.numel() else 0.0
    return {"rel_rms": float(err.norm() / merged.norm().clamp(min=1e-30)),
            "max_abs": float(err.max()) if err.numel() else 0.0,
            "max_over_bound": over, "within_bound": over <= 1.0, "bound": name}


def requantize(info, merged: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantise `merged` (the float32 logical tensor of `info`, a formats.Packed) into
    `info`'s format. Returns ({stored part name: tensor}, stats: module docstring)."""
    why = unsupported(info)
    if why:
        raise UserError(f"{info.file}: tensor {info.name}: cannot requantise {why}")
    if info.format == "mxfp4":
        return _mxfp4(info, merged)
    return _compressed_tensors(info, merged.float())


def _mxfp4(info, merged: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """GPT-OSS-layout MXFP4 (moeflow.checkpoint.mxfp4's encoder: OCP MX rules)."""
    fmt = merged.transpose(-1, -2) if info.transpose else merged  # [*lead, out, in]
    blocks, scales = mxfp4.encode(fmt)
    back = mxfp4.decode(blocks, scales, dtype=torch.float32, in_features=fmt.shape[-1])
    unit = torch.exp2(scales.float() - mxfp4.BIAS).repeat_interleave(mxfp4.BLOCK, -1)[..., :fmt.shape[-1]]
    names = {role: p.name for role, p in info.parts}
    stats = _stats((back - fmt).abs(), fmt, 2 * unit, "mxfp4: 2 x the group's power-of-two scale")
    return {names["blocks"]: blocks, names["scales"]: scales}, stats


def _compressed_tensors(info, merged: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """Any compressed-tensors format: qparams over the scheme's groups, its compressor's
    compress; the stored dtypes and shapes kept, checked against the release's."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.compressors import BaseCompressor

    scheme = _args_of(info)
    args = scheme.weights
    stored = dict(info.parts)
    scale_dtype = DTYPES[stored["weight_scale"].dtype] if "weight_scale" in stored else None
    state = qparams(merged, args, scale_dtype)
    compressor = BaseCompressor.get_value_from_registry(info.format)
    packed = compressor.compress({"weight": merged, **state}, scheme)
    module = info.name[: -len("weight")]
    out = {}
    for role, part in info.parts:
        t = packed.get(role)
        if t is None or tuple(t.shape) != tuple(part.shape):
            raise UserError(f"{part.file}: tensor {part.name}: compressed-tensors' {info.format} "
                            f"compressor gives {list(t.shape) if t is not None else 'no ' + role}, "
                            f"the release stores {list(part.shape)}")
        out[module + role] = t.to(DTYPES[part.dtype]).contiguous()
    back = compressor.decompress({role: out[module + role] for role, _ in info.parts}, scheme)["weight"]
    err = (back.float() - merged).abs()
    return out, _stats(err, merged, _bound(merged, args, state, back.dtype), f"{info.format} {args.type}"
                       f"{args.num_bits} {_strategy(args)}")


def fp8_blocks(weight_name: str, scale_name: str, merged: torch.Tensor,
               block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantise `merged` ([*lead, R, C] float32) to e4m3 with one float32 `weight_scale_inv`
    per `block` tile of each matrix (moeflow.checkpoint.fp8, DeepSeek's layout)."""
    lead = merged.shape[:-2]
    mats = merged.reshape(-1, *merged.shape[-2:])  # [L, R, C]
    codes, scales, back = [], [], []
    for m in mats:
        q, s = fp8.quantize(m, block)
        codes.append(q)
        scales.append(s)
        back.append(fp8.dequantize(q, s, block, torch.float32))
    q = torch.stack(codes).reshape(merged.shape)
    s = torch.stack(scales).reshape(*lead, *scales[0].shape)
    err = (torch.stack(back).reshape(merged.shape) - merged).abs()
    grid = torch.stack([fp8.block_grid(x, (merged.shape[-2], merged.shape[-1]), block)
                        for x in s.reshape(-1, *s.shape[-2:])]).reshape(merged.shape)  # scale per value
    bound = grid * fp8.FP8_MAX * (2.0 ** -4 + torch.finfo(torch.float32).eps)  # amax = 448 scale
    return {weight_name: q, scale_name: s}, _stats(err, merged, bound, "fp8 e4m3 weight_scale_inv blocks")


def supported_formats() -> str:
    """The formats `requantize` takes, for messages."""
    return "MXFP4 and compressed-tensors INT/FP8/NVFP4/MXFP4 (group, block, channel, tensor)"

