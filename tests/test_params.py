"""Parameter accounting: exact against transformers' own modules (meta device),
and within 1% of the published totals for the shipped real configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeflow.core.errors import UserError
from moeflow.model.params import count_params, detect_family, load_config_json, model_spec

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"

_TXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)

# tiny configs of every family, exercising dense-first / interleaved layers, MLA,
# shared experts, biases, sinks, tied embeddings and the vision towers
TINY = {
    "mixtral": ("MixtralForCausalLM", dict(_TXT, model_type="mixtral", head_dim=16,
                                           num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(_TXT, model_type="qwen3_moe", head_dim=16,
                                              moe_intermediate_size=32, num_experts=8,
                                              mlp_only_layers=[0])),
    "qwen3_moe_tied": ("Qwen3MoeForCausalLM", dict(_TXT, model_type="qwen3_moe", head_dim=16,
                                                   moe_intermediate_size=32, num_experts=8,
                                                   decoder_sparse_step=2, tie_word_embeddings=True)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        _TXT, model_type="deepseek_v3", moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1)),
    "deepseek_v3_noq": ("DeepseekV3ForCausalLM", dict(
        _TXT, model_type="deepseek_v3", moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1)),
    "gpt_oss": ("GptOssForCausalLM", dict(_TXT, model_type="gpt_oss", head_dim=16,
                                          num_local_experts=4)),
    "llama4": ("Llama4ForConditionalGeneration", dict(
        model_type="llama4", tie_word_embeddings=False,
        text_config=dict(_TXT, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
                         num_local_experts=4, interleave_moe_layer_step=2),
        vision_config=dict(hidden_size=32, intermediate_size=128, num_attention_heads=2,
                           num_hidden_layers=1, image_size=28, patch_size=14,
                           vision_output_dim=48, projector_input_dim=40,
                           projector_output_dim=40))),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", dict(
        model_type="qwen3_vl_moe", tie_word_embeddings=False,
        text_config=dict(_TXT, head_dim=16, moe_intermediate_size=32, num_experts=8),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, deepstack_visual_indexes=[0, 1],
                           num_position_embeddings=64))),
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeForConditionalGeneration", dict(
        model_type="ernie4_5_vl_moe",
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                         moe_intermediate_size=[32, 16], moe_num_experts=4, moe_k=2,
                         moe_num_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2))),
}


def _meta_params(model_class: str, cfg: dict) -> dict[str, tuple]:
    import torch
    import transformers

    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **kwargs)
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(TINY))
def test_inventory_matches_transformers_exactly(name):
    model_class, cfg = TINY[name]
    expected = _meta_params(model_class, cfg)
    spec = model_spec(json.loads(json.dumps(cfg)))
    got = {t.name: t.shape for t in spec.tensors}
    assert sorted(set(got) ^ set(expected)) == []
    assert {n: s for n, s in got.items() if expected[n] != s} == {}
    assert count_params(spec).total == sum(_numel(s) for s in expected.values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _published() -> dict:
    import yaml

    return yaml.safe_load((MODELS / "published.yaml").read_text())


def test_every_shipped_config_is_in_the_published_table():
    shipped = {p.name for p in MODELS.glob("*.json")}
    assert shipped == set(_published())


@pytest.mark.parametrize("name", sorted(_published()))
def test_published_totals_within_one_percent(name):
    row = _published()[name]
    counts = count_params(model_spec(load_config_json(MODELS / name)))
    assert abs(counts.total / 1e9 / row["total"] - 1) < row.get("tolerance", 0.01), counts.total
    if row["active"] is not None:  # published actives are rounded (37B, 3.3B)
        active = counts.active if row["active_convention"] == "embed+head" else counts.active_without_embed
        assert abs(active / 1e9 / row["active"] - 1) < 0.03, active


def test_deepseek_v3_breakdown_mla_shared_dense_first():
    spec = model_spec(load_config_json(MODELS / "deepseek-v3.json"))
    c = count_params(spec)
    assert spec.attention == "mla" and spec.moe_layers == tuple(range(3, 61))
    assert spec.kv_lora_rank == 512 and spec.qk_rope_head_dim == 64
    assert c.by_kind["router"] == 58 * 256 * 7168
    assert c.by_kind["shared_experts"] == 58 * 3 * 7168 * 2048
    assert c.by_kind["dense_mlp"] == 3 * 3 * 7168 * 18432
    assert c.by_kind["experts"] == 58 * 256 * 3 * 7168 * 2048
    # MLA: q_a + q_b + kv_a + kv_b + o (+ the two latent norms)
    attn = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
            + 1536 + 512)
    assert c.by_kind["attention"] == 61 * attn
    assert abs(c.active / 1e9 - 37.55) < 0.01


def test_multimodal_counts_vision_and_excludes_it_from_active():
    spec = model_spec(load_config_json(MODELS / "llama-4-scout-17b-16e.json"))
    c = count_params(spec)
    assert 0.8e9 < c.vision < 0.9e9
    assert c.active_by_kind.get("vision", 0) == 0
    assert c.by_kind["shared_experts"] == 48 * 3 * 5120 * 8192


def test_tied_embeddings_are_counted_once():
    _, cfg = TINY["qwen3_moe_tied"]
    c = count_params(model_spec(cfg))
    assert "head" not in c.by_kind and c.by_kind["embed"] == 100 * 64


def test_bad_configs_name_the_problem(tmp_path):
    with pytest.raises(UserError, match="not a mixture-of-experts model"):
        detect_family({"model_type": "llama"})
    with pytest.raises(UserError, match="not a transformers model class"):
        model_spec({"model_type": "my_moe", "architectures": ["MyMoeForCausalLM"]})
    with pytest.raises(UserError, match="no `model_type`"):
        model_spec({"hidden_size": 10})
    with pytest.raises(UserError, match="model config not found"):
        load_config_json(tmp_path / "nope")
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "mixtral",\n  oops}')
    with pytest.raises(UserError, match=r"config.json:2: invalid JSON"):
        load_config_json(tmp_path)


def _tiny_families() -> list[str]:
    from moeflow_testing.tiny import supported_families

    return supported_families()


@pytest.mark.parametrize("family", _tiny_families())
def test_saved_debug_configs_parse_exactly(family):
    """config.json as transformers writes it (renamed keys such as num_local_experts)."""
    import torch
    import transformers

    from moeflow_testing.tiny import FAMILIES, debug_config

    config = debug_config(family)
    saved = json.loads(config.to_json_string())
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[family].model_class)(config)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = {t.name: t.shape for t in model_spec(saved).tensors}
    assert got == expected
