"""LoRA target aliases per family, refusal of unmatched targets, frozen base."""

from __future__ import annotations

import re

import pytest
import torch

from moeflow.core.config import LoraSection
from moeflow.core.errors import UserError
from moeflow.training.lora import apply_lora, lora_config, resolve_targets


def _meta_model(family: str, **overrides):
    from transformers import AutoModelForCausalLM

    from moeflow_testing.tiny import debug_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(debug_config(family, **overrides))


def _lora(targets, dropout=0.0, rank=4):
    return LoraSection(rank=rank, alpha=8, dropout=dropout, target_modules=targets)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_aliases_resolve_per_family(family):
    model = _meta_model(family)
    t = resolve_targets(model, ["attention", "experts", "router"])
    assert len(t.matched["attention"]) == 2 * 4  # 2 layers x q/k/v/o
    assert t.parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    regex = t.module_regex()
    names = [n for n, _ in model.named_modules()]
    hit = [n for n in names if re.fullmatch(regex, n)]
    assert sorted(hit) == sorted(t.modules)


def test_mla_attention_alias_targets_deepseek_projections():
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                           num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=8, first_k_dense_replace=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    t = resolve_targets(model, ["attention", "experts"])
    leaves = {n.rsplit(".", 1)[1] for n in t.matched["attention"]}
    assert leaves == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert t.matched["experts"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    # PEFT 0.21 renames shared_experts.gate_proj/up_proj/down_proj of DeepSeek-V3 to the
    # fused routed experts (an adapter on the wrong tensors): refused, saying why
    with pytest.raises(UserError, match="renames to fused routed-expert tensors"):
        resolve_targets(model, ["shared_experts"])


def test_unmatched_target_is_refused_listing_what_exists():
    model = _meta_model("qwen3_moe")
    with pytest.raises(UserError) as err:
        resolve_targets(model, ["attention", "w1"])
    msg = str(err.value)
    assert "'w1' matches nothing" in msg and "q_proj" in msg and "mlp.experts.gate_up_proj" in msg
    with pytest.raises(UserError, match="'shared_experts' matches nothing"):
        resolve_targets(model, ["shared_experts"])


def test_explicit_names_and_dropout_rule():
    model = _meta_model("qwen3_moe")
    t = resolve_targets(model, ["q_proj", "mlp.experts.down_proj"])
    assert all(n.endswith("q_proj") for n in t.modules) and t.parameters == ["mlp.experts.down_proj"]
    with pytest.raises(UserError, match="lora.dropout"):
        lora_config(t, _lora(["q_proj"], dropout=0.1))
    assert lora_config(resolve_targets(model, ["attention"]), _lora(["attention"], dropout=0.1)).lora_dropout


@pytest.mark.parametrize("targets", [["attention"], ["attention", "experts"]])
def test_apply_lora_freezes_the_base(targets):
    from transformers import AutoModelForCausalLM

    from moeflow_testing.tiny import debug_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(debug_config("qwen3_moe", hidden_size=128))
    peft_model, t, sizes = apply_lora(model, _lora(targets))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sizes["trainable_params"] == sum(p.numel() for n, p in peft_model.named_parameters()
                                            if p.requires_grad)
    if targets == ["attention"]:
        assert sizes["trainable_pct"] < 3.0
    else:
        assert any("experts" in n for n in trainable)


def test_attention_lora_is_under_one_percent_at_real_scale():
    """Mixtral-8x7B shapes on the meta device (no memory): attention LoRA r=16 << 1%."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(MixtralConfig())
    _, _, sizes = apply_lora(model, _lora(["attention"], rank=16))
    assert sizes["total_params"] > 46e9 and sizes["trainable_pct"] < 0.1
    assert sizes["lora_bytes"] * 1000 < sizes["base_bytes"]


def test_router_that_is_a_linear_subclass_is_a_target_parameter():
    """Llama4's router subclasses nn.Linear but returns (scores, logits): wrapped as a
    LoRA module its forward broke ('tuple' has no dtype); as a target parameter it trains."""
    from moeflow_testing.tiny_auto import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama4_text").float()
    peft_model, targets, _ = apply_lora(model, _lora(["router"]))
    assert targets.parameters == ["feed_forward.router.weight"] and not targets.modules
    ids = torch.arange(3, 11).reshape(1, 8)  # [1, 8]
    peft_model(input_ids=ids, labels=ids).loss.backward()
    grads = [n for n, p in peft_model.named_parameters() if "router.lora_" in n and p.grad is not None]
    assert grads and all(torch.isfinite(p.grad).all() for n, p in peft_model.named_parameters()
                         if n in grads)
