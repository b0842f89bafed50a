"""load_model's dtype unification: a checkpoint whose unquantised modules were stored in
another float dtype (calibrate's FP8 copy keeps sensitive experts in bf16) computes in the
dtype asked for; demo regress once failed on it with the eager experts kernel
(`expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16`)."""

from __future__ import annotations

import torch

from moeflow.model.models import unify_dtype


def _tiny():
    from transformers import AutoModelForCausalLM

    from moeflow_testing.tiny import debug_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(debug_config("qwen3_moe")).float().eval()
    model.set_experts_implementation("eager")  # the kernel that does not cast its input
    return model


def test_bf16_experts_in_an_fp32_model_are_upcast_and_eager_runs():
    model = _tiny()
    experts = model.model.layers[0].mlp.experts
    experts.to(torch.bfloat16)
    ids = torch.tensor([[3, 5, 7, 11]])
    try:
        model(ids)
        raise AssertionError("mixed dtypes ran: the test no longer reproduces the failure")
    except RuntimeError as exc:
        assert "same dtype" in str(exc)
    unify_dtype(model, torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_quantised_modules_and_bf16_models_are_left_as_stored():
    model = _tiny()
    experts = model.model.layers[0].mlp.experts
    experts.quantization_scheme = object()  # compressed-tensors marks its quantised modules so
    experts.to(torch.bfloat16)
    unify_dtype(model, torch.float32)
    assert experts.gate_up_proj.dtype == torch.bfloat16
    bf16 = _tiny().to(torch.bfloat16)
    router = bf16.model.layers[0].mlp.gate
    router.to(torch.float32)  # what a class's _keep_in_fp32_modules gives a bf16 load
    unify_dtype(bf16, torch.bfloat16)
    assert router.weight.dtype == torch.float32
