"""Checkpoints whose tensors are not all in one dtype (calibrate's FP8 copy of a bf16 GLM-4.5:
FP8 linears, bf16 fused experts kept unquantised, fp32 scales) load in the dtype asked for and
run with every experts kernel: the held-out GLM-4.5 once failed here at regress
(`expected m1 and m2 to have the same dtype`) through compressed-tensors' wrapper."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def glm_fp8(tmp_path_factory):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.quant.quantize import default_ignore, quantize_checkpoint
    from moeflow.quant.schemes import get_scheme
    from moeflow.quant.source import ModelSource
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("glm")
    base = build_debug_model("glm4_moe", root / "base", dtype="bfloat16")
    convert_checkpoint(base, root / "conv", dtype="bf16", workers=1)
    quantize_checkpoint(root / "conv", root / "fp8", get_scheme("fp8"),
                        default_ignore(ModelSource(str(root / "conv"))))
    return root / "fp8"


@pytest.mark.parametrize("kernel", ["eager", "batched_mm", "grouped_mm"])
def test_calibrated_glm_runs_in_float32_with_every_kernel(glm_fp8, kernel):
    from moeflow.model.models import load_model

    model = load_model(glm_fp8, torch.float32, experts_implementation=kernel).eval().to("cpu")
    stray = {n: p.dtype for n, p in model.named_parameters()
             if p.dtype in (torch.bfloat16, torch.float16)}
    assert not stray, stray  # everything not stored FP8 computes in the dtype asked for
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        model.generate(ids, max_new_tokens=2, do_sample=False)
