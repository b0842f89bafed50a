"""FP8 block-scaled weights (DeepSeek-V3 style): dequantise and quantise.

A weight W [R, C] is stored as e4m3 `weight` plus float32 `weight_scale_inv`
[ceil(R/br), ceil(C/bc)] for `weight_block_size` [br, bc]; the real value is
W[i, j] = weight[i, j] * weight_scale_inv[i // br, j // bc]. This is the
formula of DeepSeek's `weight_dequant` and transformers' FP8 integration;
hand-written here because it must run per tensor on CPU while streaming.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    r, c = shape
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:r, :c]  # [R, C]


def block_grid(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Each value's block scale: [ceil(R/br), ceil(C/bc)] spread to [R, C]."""
    return _expand(scale, shape, block)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """Dequantise one block-scaled FP8 matrix.

    Args:
        weight: [R, C] float8_e4m3fn, or [*lead, R, C] (fused experts: one matrix per
            leading index, as `convert --dtype fp8` keeps them).
        scale_inv: [ceil(R/br), ceil(C/bc)] float32 ([*lead, ...] with the weight's lead).
        block: (br, bc), the config's `weight_block_size`.
        dtype: output dtype.

    Returns:
        [*lead, R, C] tensor of `dtype` (computed in float32, rounded once).
    """
    if weight.dim() > 2 and scale_inv.dim() == weight.dim() \
            and weight.shape[:-2] == scale_inv.shape[:-2]:
        mats = [dequantize(w, s, block, dtype) for w, s in
                zip(weight.reshape(-1, *weight.shape[-2:]), scale_inv.reshape(-1, *scale_inv.shape[-2:]))]
        return torch.stack(mats).reshape(weight.shape) if mats else \
            torch.empty(weight.shape, dtype=dtype)
    if weight.dim() != 2:
        raise ValueError(f"block-scaled FP8 expects a matrix, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv shape {list(scale_inv.shape)} does not match "
                         f"weight {list(weight.shape)} with blocks {list(block)} (want {list(want)})")
    full = _expand(scale_inv.float(), (rows, cols), block)  # [R, C]
    return (weight.float() * full).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a matrix to e4m3 with one float32 scale per block (amax / 448).

    Returns:
        (fp8 weight [R, C], weight_scale_inv [ceil(R/br), ceil(C/bc)]).
    """
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.reshape(nr, br, nc, bc)  # [nr, br, nc, bc]
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [nr, nc]
    scale = amax / FP8_MAX  # [nr, nc]
    q = (blocks / scale[:, None, :, None]).reshape(nr * br, nc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale
