"""Tiny configs derived from a family's default config (moeflow_testing.tiny_auto) for the
shapes of default config that used to fail: per-layer kind lists left unset, indexer
sizes left unset, heterogeneous per-layer overrides, MLA head-dim relations, M-RoPE
defaults kept in modeling code, hybrids of only recurrent layers, experts switched
off, and token ids the modeling code reads but the config does not declare.
Every model here is random, a few hundred kB, and runs one forward on CPU."""

from __future__ import annotations

import pytest
import torch

from moeflow.core.errors import UserError
from moeflow_testing.tiny_auto import tiny_config, tiny_model


def _forward(model_type: str, config=None, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    model = tiny_model(model_type, config=config).eval()
    ids = torch.arange(3, 11).reshape(1, 8)  # [1, 8]
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits  # [1, 8, V]
    assert logits.shape[:2] == (1, 8) and torch.isfinite(logits).all()
    return logits


def test_unset_layer_kind_lists_come_from_the_modeling_code():
    lfm = tiny_config("lfm2_moe")
    assert lfm.layer_types == ["full_attention", "conv"]  # default: None, never derived
    ocr = tiny_config("deepseek_ocr2").text_config
    assert ocr.mlp_layer_types == ["dense", "sparse"]
    _forward("lfm2_moe", lfm)


def test_indexer_sizes_are_set_for_indexed_attention_layers():
    cfg = tiny_config("qwen4_exp_text")
    assert "indexed_attention" in cfg.layer_types
    assert cfg.indexer_n_heads and cfg.indexer_kv_heads == 1
    assert cfg.indexer_budget % cfg.indexer_compress_ratio == 0
    tiny_model("qwen4_exp_text", config=cfg)


def test_per_layer_overrides_keep_head_dim_equal_nope_plus_rope():
    cfg = tiny_config("dots3_note_text")
    sliding = cfg.per_layer_config["sliding_attention"]
    assert sliding.head_dim == sliding.qk_nope_head_dim + sliding.qk_rope_head_dim
    assert sliding.num_attention_heads == sliding.num_key_value_heads  # MHA kept
    assert cfg.hidden_size == 64 and sliding.kv_lora_rank <= 64


def test_zero_sizes_stay_zero():
    assert tiny_config("glm5_next").text_config.qk_rope_head_dim == 0  # NoPE attention


def test_mla_head_dim_follows_the_full_size_relation():
    cfg = tiny_config("mistral4")  # full size: head_dim 128 = nope 64 + rope 64
    assert cfg.head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert tiny_config("deepseek_v3").head_dim == tiny_config("deepseek_v3").qk_rope_head_dim
    _forward("mistral4", cfg)


def test_mrope_default_of_the_modeling_code_is_cut_to_the_tiny_head():
    cfg = tiny_config("glm4v_moe").text_config
    rope = cfg.rope_parameters
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert sum(rope["mrope_section"]) == int(head * rope.get("partial_rotary_factor", 1.0)) // 2
    _forward("glm4v_moe")


def test_sliding_window_where_the_family_sizes_sliding_layers():
    cfg = tiny_config("step3p7").text_config
    assert cfg.sliding_window == 16
    _forward("step3p7")


def test_hybrid_of_recurrent_layers_keeps_an_attention_layer():
    cfg = tiny_config("granitemoehybrid")
    assert cfg.layer_types == ["linear_attention", "full_attention"]
    _forward("granitemoehybrid", cfg, use_cache=True)  # a cache of linear layers only raised


def test_dense_only_layer_lists_leave_a_sparse_layer():
    assert tiny_config("flint").mlp_only_layers == [0]
    model = tiny_model("flint")
    assert any(p.dim() == 3 for n, p in model.named_parameters() if ".experts." in n)


def test_linear_attention_is_debug_sized():
    cfg = tiny_config("kimi_linear")
    assert cfg.linear_head_dim == 16 and cfg.linear_num_heads == 4


def test_token_ids_the_modeling_code_reads_are_declared():
    cfg = tiny_config("qwen3_omni_moe_thinker")
    ids = {k: v for k, v in cfg.to_dict().items() if k.endswith("_token_id") and isinstance(v, int)}
    assert 0 < cfg.vision_start_token_id < cfg.text_config.vocab_size
    assert list(ids.values()).count(cfg.vision_start_token_id) == 1


def test_experts_switched_off_are_switched_on_and_unfused_experts_refused(tmp_path):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.tiny import build_debug_model

    assert tiny_config("doge").is_moe is True
    src = build_debug_model("doge", tmp_path / "doge", max_shard_size="200KB")
    with pytest.raises(UserError, match="routed experts are not fused"):
        convert_checkpoint(src, tmp_path / "out")


def test_grouped_linear_is_not_a_lora_target():
    from moeflow.training.lora import plain_linear, resolve_targets

    model = tiny_model("deepseek_v4")
    grouped = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not plain_linear(m)]
    assert grouped  # DeepSeek-V4's block-diagonal output projection
    targets = resolve_targets(model, ["attention"])
    assert targets.modules and not set(grouped) & set(targets.modules)


def test_padded_vocab_head_converts_and_verifies(tmp_path):
    """Inkling2 stores its unembedding padded to vocab_size and unpads on load; the
    converter's op casts to the meta model's dtype, which must not leak (bf16 out)."""
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.tiny import build_debug_model

    src = build_debug_model("inkling2_text", tmp_path / "src", max_shard_size="200KB")
    out = convert_checkpoint(src, tmp_path / "out")
    assert out["report"]["functional"]["within_tolerance"] or out["report"]["functional"]["logits_equal"]


def test_depth_named_num_layers_is_cut_and_mla_is_attention():
    from moeflow.training.lora import resolve_targets

    cfg = tiny_config("longcat_flash")  # LongCat-Flash: num_layers, two MLA blocks a layer
    assert cfg.num_layers == 2
    targets = resolve_targets(tiny_model("longcat_flash", config=cfg), ["attention"])
    assert any(m.endswith("self_attn.0.q_a_proj") for m in targets.modules)
