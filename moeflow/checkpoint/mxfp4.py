"""MXFP4 weights as GPT-OSS (and releases in its layout) store them.

A weight W [*lead, out, in] is stored as two tensors named after it:

    <name>_blocks  uint8 [*lead, out, G, 16]   two FP4 (E2M1) codes per byte, low nibble first
    <name>_scales  uint8 [*lead, out, G]       one E8M0 exponent (bias 127) per 32 values

with G = ceil(in / 32): values are grouped along the last (input) dimension, 32
per shared exponent (the OCP MX format). W[..., o, 32 g + k] = FP4[code] * 2^(scale - 127).

`decode` runs transformers' own MXFP4 dequantiser (`convert_moe_packed_tensors`,
what `from_pretrained` uses on a host without MXFP4 kernels) and returns the
format's [*lead, out, in] layout; whether a model holds the transpose
(GPT-OSS's experts hold [E, in, out]) is the caller's business. transformers'
encoder needs GPU kernels, so `encode` is written here, after the OCP MX
specification (shared exponent floor(log2(amax)) - 2, values rounded to the
nearest E2M1 code, ties to even, saturating at 6); `decode(encode(w))` is
checked against transformers' decoder in the tests.
"""

from __future__ import annotations

import torch

from moeflow.core.errors import UserError

BLOCK = 32  # values per shared exponent
BIAS = 127  # E8M0 exponent bias
EMAX = 2  # largest E2M1 exponent: 6 = 1.5 * 2**2


def check(blocks_shape, scales_shape, name: str, blocks_dtype: str = "U8",
          scales_dtype: str = "U8") -> None:
    """Reject a `_blocks`/`_scales` pair that is not MXFP4 in this layout (one line, naming it)."""
    if blocks_dtype != "U8" or scales_dtype not in ("U8", "F8_E8M0"):
        raise UserError(f"tensor {name}_blocks/{name}_scales: MXFP4 wants uint8 blocks and "
                        f"uint8/e8m0 scales, got {blocks_dtype}/{scales_dtype}")
    if len(blocks_shape) < 3 or blocks_shape[-1] != BLOCK // 2 \
            or tuple(blocks_shape[:-1]) != tuple(scales_shape):
        raise UserError(f"tensor {name}_blocks {list(blocks_shape)} / {name}_scales "
                        f"{list(scales_shape)}: not MXFP4 [*lead, out, G, 16] / [*lead, out, G]")


def decoded_shape(blocks_shape) -> tuple[int, ...]:
    """[*lead, out, G*32]: the padded format-layout shape of a `_blocks` tensor."""
    return (*blocks_shape[:-2], blocks_shape[-2] * BLOCK)


def decode(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16,
           in_features: int | None = None, name: str = "weight") -> torch.Tensor:
    """Dequantise MXFP4 to [*lead, out, in] in `dtype` (transformers' decoder).

    Args:
        blocks: uint8 [*lead, out, G, 16].
        scales: uint8 (or float8_e8m0fnu) [*lead, out, G].
        dtype: output dtype (transformers computes in it: exact for bf16 and wider,
            since every MXFP4 value is a 2-bit mantissa times a power of two).
        in_features: the real input width when it is not a multiple of 32; the
            padding values must then be zero.
        name: the weight's name, for error messages.

    Returns:
        [*lead, out, in] tensor (contiguous).
    """
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    check(tuple(blocks.shape), tuple(scales.shape), name)
    if scales.dtype != torch.uint8:
        scales = scales.view(torch.uint8)
    lead = blocks.shape[:-3]
    b4 = blocks.reshape(-1, *blocks.shape[-3:])  # [L, out, G, 16]
    s3 = scales.reshape(-1, *scales.shape[-2:])  # [L, out, G]
    if b4.shape[0] == 0:
        return torch.empty((*lead, blocks.shape[-3], in_features or blocks.shape[-2] * BLOCK),
                           dtype=dtype)
    # transformers returns GPT-OSS's [L, in, out]; the format's own layout is [L, out, in]
    w = convert_moe_packed_tensors(b4, s3, dtype=dtype).transpose(1, 2)  # [L, out, G*32]
    w = w.reshape(*lead, *w.shape[1:])
    padded = w.shape[-1]
    if in_features is not None and in_features != padded:
        if not padded - BLOCK < in_features < padded:
            raise UserError(f"tensor {name}_blocks: {blocks.shape[-2]} groups of 32 cannot hold "
                            f"{in_features} input values")
        if bool((w[..., in_features:] != 0).any()):
            raise UserError(f"tensor {name}_blocks: padding beyond input width {in_features} "
                            "is not zero (not an MXFP4 encoding of that width)")
        w = w[..., :in_features]
    return w.contiguous()


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes of codes 0..7


def encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise [*lead, out, in] to MXFP4 (`_blocks`, `_scales`); `in` is zero-padded to 32.

    Returns:
        (uint8 [*lead, out, G, 16], uint8 [*lead, out, G]).
    """
    w = weight.float()
    *lead, out, n = w.shape
    groups = -(-n // BLOCK)
    if groups * BLOCK != n:
        w = torch.nn.functional.pad(w, (0, groups * BLOCK - n))
    g = w.reshape(*lead, out, groups, BLOCK)  # [*lead, out, G, 32]
    amax = g.abs().amax(dim=-1)  # [*lead, out, G]
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - EMAX,
                      torch.full_like(amax, -BIAS))
    exp = exp.clamp(-BIAS, BIAS)  # [*lead, out, G]
    x = g / torch.exp2(exp)[..., None]  # [*lead, out, G, 32], |x| < 8
    mag = x.abs().clamp(max=6.0)
    # nearest E2M1 magnitude, ties to the even code (the lower one on a tie, codes step by 1)
    dist = (mag[..., None] - _E2M1).abs()  # [..., 32, 8]
    code = dist.argmin(dim=-1).to(torch.uint8)  # argmin picks the first (even) code on ties
    code = code | ((x < 0) & (code > 0)).to(torch.uint8) << 3  # sign bit; -0 stored as +0
    pairs = code.reshape(*lead, out, groups, BLOCK // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)  # low nibble first
    scales = (exp + BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
