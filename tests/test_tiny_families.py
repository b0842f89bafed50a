"""Every supported family's debug model is written in the family's real on-disk
layout and loads back with transformers exactly."""

import json

import pytest
import torch
from safetensors import safe_open

from moeflow_testing.tiny import FAMILIES, build_debug_model, build_fp8_debug_model

CORPUS = ["reverse: a b c\nanswer: c b a"] * 8


def _keys(path):
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                out[k] = (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    built = {fam: build_debug_model(fam, root / fam, corpus=CORPUS) for fam in FAMILIES}
    built["fp8"] = build_fp8_debug_model(root / "fp8", corpus=CORPUS)
    return built


def test_all_issue_families_have_debug_models():
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe", "ernie4_5_vl_moe",
            "llama4"} <= set(FAMILIES)


def test_sharded_layout(models):
    for fam, path in models.items():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, fam
        assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file(), fam
        assert set(index["weight_map"]) == set(_keys(path)), fam


def test_real_on_disk_names(models):
    k = {fam: _keys(p) for fam, p in models.items()}
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in k["mixtral"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in k["qwen3_moe"]
    ds = k["deepseek_v3"]
    assert "model.layers.0.mlp.gate_proj.weight" in ds  # dense first layer
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in ds
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in ds
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in ds  # MLA
    assert k["gpt_oss"]["model.layers.0.mlp.experts.gate_up_proj"][0] == (4, 64, 64)
    assert "model.layers.0.self_attn.sinks" in k["gpt_oss"]
    # Qwen3-VL-MoE ships fused experts as [E, H, 2I] / [E, I, H] (runtime is transposed)
    vl = k["qwen3_vl_moe"]
    assert vl["model.language_model.layers.0.mlp.experts.gate_up_proj"][0] == (8, 64, 32)
    assert vl["model.language_model.layers.0.mlp.experts.down_proj"][0] == (8, 16, 64)
    assert any(n.startswith("model.visual.blocks.") for n in vl)
    er = k["ernie4_5_vl_moe"]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in er  # text 0-3, vision 4-7
    assert er["model.layers.1.mlp.gate.weight"][0] == (64, 4)  # stored [H, E]
    assert "model.layers.1.mlp.gate.weight_1" in er
    assert any(n.startswith("model.vision_model.") for n in er)
    l4 = k["llama4"]
    assert "language_model.model.layers.0.feed_forward.experts.gate_up_proj" in l4
    assert "multi_modal_projector.linear_1.weight" in l4
    assert any(n.startswith("vision_model.") for n in l4)


def test_fp8_variant(models):
    keys = _keys(models["fp8"])
    w, s = "model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"
    assert keys[w] == ((48, 64), "F8_E4M3") and keys[s] == ((3, 4), "F32")
    assert keys["model.layers.1.self_attn.q_b_proj.weight_scale_inv"][0] == (8, 2)  # [128, 32] / 16
    assert keys["model.layers.1.mlp.gate.weight"][1] == "BF16"  # router stays
    cfg = json.loads((models["fp8"] / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [16, 16]
    assert cfg["quantization_config"]["fmt"] == "e4m3"


@pytest.mark.parametrize("fam", ["deepseek_v3", "ernie4_5_vl_moe", "llama4"])
def test_reload_exact(models, fam):
    import transformers

    cls = getattr(transformers, FAMILIES[fam].model_class)
    model, info = cls.from_pretrained(str(models[fam]), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.dtype == torch.bfloat16 for p in model.parameters()) > 10
