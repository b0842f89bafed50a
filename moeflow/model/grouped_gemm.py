"""The experts' grouped GEMM, also inside compiled forwards on CPU in float32.

transformers' grouped experts forward (`grouped_mm`) multiplies each expert's
rows by its weight with torch's native grouped GEMM (`torch._grouped_mm`, one
call for all experts). Under `torch.compile` it cannot: torch's shape function
for that op accepts bfloat16 only, so for any other dtype transformers routes
the GEMM through its own custom op, a Python loop of one `torch.mm` per expert
(plus a Python autograd layer around it). On CPU, where the served model is
float32, that loop took about a quarter of the demo model's compiled decode step.

`grouped_mm` here is transformers' dispatcher with one more case: while
compiling, for a CPU weight that is not bfloat16, it calls `moeflow::grouped_mm`,
an operator whose kernel is torch's native grouped GEMM in eager mode (it takes
float32 on CPU) and whose shape function is written below. It is registered
straight on the CPU dispatch key, without a Python autograd layer (it has no
backward, so it is taken only where gradients are off: compiled serving
forwards run under no_grad; training does not compile). Everywhere else --
eager, bfloat16, GPUs -- the call is transformers' own, unchanged.

    out = grouped_mm(x, w, offsets)   # x [S, in] sorted by expert, w [E, in, out], offsets [E]
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import _grouped_mm

# Written here rather than taken from a library: torch (2.13) ships no float32 shape
# function for its grouped GEMM, and transformers' stand-in is the per-expert loop above.
_LIB = torch.library.Library("moeflow", "DEF")  # kept: the operator lives as long as this object
_LIB.define("grouped_mm(Tensor input, Tensor weight, Tensor offs) -> Tensor")


def _native(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(input, weight, offs=offs)


def _shape(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return input.new_empty(input.size(0), weight.size(2))


_LIB.impl("grouped_mm", _native, "CPU")
torch.library.register_fake("moeflow::grouped_mm", _shape, lib=_LIB)


def _native_cpu() -> bool:
    """Whether torch's grouped GEMM runs on CPU for any dtype and alignment (torch > 2.10)."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return hasattr(torch, "_grouped_mm") and version >= (2, 11)


NATIVE_CPU = _native_cpu()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x·W_e per expert group: x [S, in] sorted by expert, w [E, in, out], offsets [E]
    (cumulative rows per expert) -> [S, out]."""
    if (NATIVE_CPU and w.device.type == "cpu" and w.dtype != torch.bfloat16 and torch.compiler.is_compiling()
            and not torch.is_grad_enabled()):  # the operator has no backward
        return torch.ops.moeflow.grouped_mm(x.to(w.dtype), w, offsets)
    return _grouped_mm(x, w, offs=offsets)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None,
                   is_transposed: bool = False) -> torch.Tensor:
    """transformers' grouped linear (weight [E, in, out] when transposed, else [E, out, in];
    bias [S, out] already gathered per row) through `grouped_mm`."""
    out = grouped_mm(x, w if is_transposed else w.transpose(-2, -1), offsets)
    if bias is not None:
        out.add_(bias)
    return out
