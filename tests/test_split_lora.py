"""Split expert LoRA (moeflow/model/split_lora.py): the same numbers as PEFT's folded path, in
PEFT's own adapter format, never silently skipped, and timed by the operators stage."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, inject_adapter_in_model
from peft.tuners.lora.layer import ParamWrapper

from moeflow.core.config import LoraSection
from moeflow.model.split_lora import SPLIT_IMPL, SplitParamWrapper, enable_split_lora


def _set_impl(module: torch.nn.Module, impl: str) -> None:
    for m in module.modules():
        if getattr(m, "config", None) is not None and hasattr(m, "num_experts"):
            m.config._experts_implementation = impl


def _meta_free_model(family: str, **overrides):
    from transformers import AutoModelForCausalLM

    from moeflow_testing.tiny import debug_config

    torch.manual_seed(0)
    config = debug_config(family, **overrides)
    config._experts_implementation = "grouped_mm"
    model = AutoModelForCausalLM.from_config(config).float()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _randomise_lora(model: torch.nn.Module, seed: int = 1) -> None:
    """LoRA B starts at zero (no gradient for A): give every factor values so both are tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _step(model, batch):
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logits.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # [E, out, in]; transposed + biases + own gate
def test_split_equals_peft_folded_loss_logits_and_every_gradient(family):
    base = _meta_free_model(family)
    conf = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft = inject_adapter_in_model(conf, base)
    _randomise_lora(peft)
    split = copy.deepcopy(peft)
    assert enable_split_lora(split) == 2 * split.config.num_hidden_layers
    _set_impl(split, SPLIT_IMPL)
    batch = {"input_ids": torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(2))}

    loss_p, logits_p, grads_p = _step(peft, batch)
    loss_s, logits_s, grads_s = _step(split, batch)
    assert abs(float(loss_p - loss_s)) <= 1e-5 * abs(float(loss_p))
    assert _rel(logits_s, logits_p) < 1e-5
    assert grads_p.keys() == grads_s.keys() and len(grads_p) == 4 * split.config.num_hidden_layers
    worst = max(_rel(grads_s[n], grads_p[n]) for n in grads_p)
    assert worst < 1e-5, worst


def test_wrapper_falls_back_to_peft_when_the_experts_run_another_implementation():
    """A split-capable wrapper under grouped_mm must still apply the adapter (PEFT's fold):
    the output differs from the base and equals PEFT's."""
    base = _meta_free_model("qwen3_moe")
    batch = {"input_ids": torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(3))}
    with torch.no_grad():
        plain = base(**batch).logits
    conf = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj"])
    peft = inject_adapter_in_model(conf, base)
    _randomise_lora(peft)
    reference = copy.deepcopy(peft)
    enable_split_lora(peft)  # implementation stays grouped_mm
    with torch.no_grad():
        adapted, expected = peft(**batch).logits, reference(**batch).logits
    assert _rel(adapted, plain) > 1e-3
    assert _rel(adapted, expected) < 1e-6


def test_adapter_trained_split_saves_and_loads_as_plain_peft(tmp_path):
    """apply_lora makes expert wrappers split-capable; the saved adapter is PEFT's format:
    a stock PeftModel (no moeflow code) computes the same logits from it."""
    from moeflow.training.lora import apply_lora

    model = _meta_free_model("qwen3_moe")
    lora = LoraSection(rank=4, alpha=8, dropout=0.0, target_modules=["experts"])
    peft_model, targets, _ = apply_lora(model, lora)
    assert targets.parameters and any(isinstance(m, SplitParamWrapper) for m in peft_model.modules())
    _randomise_lora(peft_model)
    _set_impl(peft_model, SPLIT_IMPL)
    batch = {"input_ids": torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(4))}
    with torch.no_grad():
        trained = peft_model(**batch).logits
    peft_model.save_pretrained(tmp_path / "adapter")

    fresh = _meta_free_model("qwen3_moe")  # same seed: the same base weights
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    assert not any(isinstance(m, SplitParamWrapper) for m in loaded.modules())
    assert any(type(m) is ParamWrapper for m in loaded.modules())
    with torch.no_grad():
        stock = loaded(**batch).logits
    assert _rel(trained, stock) < 1e-5


def test_operators_times_split_lora_as_one_more_implementation():
    from moeflow.operators.opbench import bench_block, offered_implementations
    from moeflow_testing.tiny import debug_config

    assert SPLIT_IMPL in offered_implementations()
    result = bench_block(debug_config("qwen3_moe"), tokens=32, dtype="float32", lora_rank=4, reps=1,
                         impls=["grouped_mm", SPLIT_IMPL])
    rows = {r["implementation"]: r for r in result["rows"]}
    assert rows[SPLIT_IMPL]["available"] and rows[SPLIT_IMPL]["train_s"] > 0
    # training goes to the faster forward+backward of the two timed, whichever that was here
    assert result["chosen"]["training"] == min(rows, key=lambda i: rows[i]["train_s"])
