"""Any MoE family transformers ships: roles from the module tree, exact counts of
every shipped config, configs by architecture (Kimi-K2), conversion verified in
the target dtype, and families beyond the original seven through the stages."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from moeflow.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
NEW = ("glm4_moe", "olmoe", "qwen2_moe")  # not in the original seven


def _bench():
    spec = importlib.util.spec_from_file_location("bench_families", ROOT / "benchmarks" / "families.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _meta_total(raw: dict) -> int:
    """transformers' own count: the architecture's class on the meta device."""
    import transformers
    from transformers import CONFIG_MAPPING

    cls = getattr(transformers, raw["architectures"][0])
    config_cls = CONFIG_MAPPING[raw["model_type"]] if raw["model_type"] in CONFIG_MAPPING else cls.config_class
    config = config_cls.from_dict({k: v for k, v in raw.items() if k != "auto_map"})
    with torch.device("meta"):
        model = cls(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS.glob("*.json")))
def test_plan_counts_every_shipped_config_to_the_parameter(name):
    from moeflow.model.params import count_params, spec_from_path

    raw = json.loads((MODELS / name).read_text())
    assert count_params(spec_from_path(MODELS / name)).total == _meta_total(raw)


def test_kimi_k2_is_planned_by_its_architecture():
    from moeflow.model.params import count_params, detect_family, load_config_json, model_spec

    raw = load_config_json(MODELS / "kimi-k2.json")
    assert raw["model_type"] == "kimi_k2" and "auto_map" in raw  # remote code never runs
    spec = model_spec(raw)
    assert detect_family(raw) == "kimi_k2" and spec.attention == "mla"
    assert spec.num_experts == 384 and spec.experts_per_tok == 8 and spec.moe_layers == tuple(range(1, 61))
    assert count_params(spec).by_kind["shared_experts"] == 60 * 3 * 7168 * 2048


def test_kimi_k2_checkpoint_loads_and_converts_without_remote_code(tmp_path):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.model.models import auto_class
    from moeflow_testing.tiny import build_debug_model

    src = build_debug_model("deepseek_v3", tmp_path / "kimi")
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (src / "config.json").write_text(json.dumps(config))
    assert auto_class(src).__name__ == "DeepseekV3ForCausalLM"
    out = Path(convert_checkpoint(src, tmp_path / "out")["output_dir"])  # verified
    converted = json.loads((out / "config.json").read_text())
    assert converted["model_type"] == "deepseek_v3" and converted["original_model_type"] == "kimi_k2"
    assert "auto_map" not in converted


def test_unknown_architecture_is_one_line():
    from moeflow.model.params import model_spec

    with pytest.raises(UserError, match=r"'my_moe' \(architectures \['MyMoeForCausalLM'\]\) is not a transformers"):
        model_spec({"model_type": "my_moe", "architectures": ["MyMoeForCausalLM"]})


# ------------------------------------------------------------ conversion dtype


@pytest.fixture(scope="module")
def fp32_qwen(tmp_path_factory):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("fp32")
    src = build_debug_model("qwen3_moe", root / "src", dtype="float32")
    return src, Path(convert_checkpoint(src, root / "out")["output_dir"])  # bf16, verified


def test_fp32_checkpoint_converted_to_bf16_verifies(fp32_qwen):
    from moeflow.checkpoint.verify import narrowed_tensors

    _, out = fp32_qwen
    manifest = json.loads((out / "manifest.json").read_text())
    assert {e["dtype"] for e in manifest["tensors"].values()} == {"BF16"}
    assert len(narrowed_tensors(manifest)) == len(manifest["tensors"])


def test_swapped_experts_still_fail_verification(fp32_qwen, tmp_path):
    from safetensors.torch import load_file, save_file

    from moeflow.checkpoint.verify import functional_check, verify_converted

    src, out = fp32_qwen
    bad = tmp_path / "swapped"
    shutil.copytree(out, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    shard = bad / manifest["tensors"][name]["file"]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][[1, 0, *range(2, tensors[name].shape[0])]].contiguous()  # [E, 2I, H]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    fn = functional_check(src, bad, manifest)
    assert fn["logits_equal"] is False and not fn["within_tolerance"]
    assert fn["source_rounded_to_output"]
    report = verify_converted(bad, src, functional=False)
    assert not report["passed"]


def test_keep_in_fp32_modules_stay_fp32(tmp_path):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.tiny import build_debug_model

    src = build_debug_model("deepseek_v3", tmp_path / "src", dtype="float32")
    out = Path(convert_checkpoint(src, tmp_path / "out")["output_dir"])
    tensors = json.loads((out / "manifest.json").read_text())["tensors"]
    # DeepseekV3's _keep_in_fp32_modules_strict: e_score_correction_bias, gate.weight
    kept = {n for n, e in tensors.items() if e["dtype"] == "F32"}
    assert kept and all(n.endswith(("mlp.gate.weight", "e_score_correction_bias")) for n in kept)
    assert any(n.endswith("e_score_correction_bias") for n in kept)
    assert {e["dtype"] for n, e in tensors.items() if n not in kept} == {"BF16"}


# ------------------------------------------------------------ roles of new families


@pytest.mark.parametrize("family", NEW)
def test_roles_aliases_and_routers_of_new_families(family):
    from moeflow.model.anatomy import from_model
    from moeflow.model.routing import find_routers
    from moeflow.training.lora import _peft_remapped_leaves, resolve_targets
    from moeflow_testing.tiny_auto import tiny_model

    model = tiny_model(family)
    an = from_model(model)
    kinds = an.by_kind()
    assert kinds["experts"] > 0 and kinds["router"] > 0 and kinds["attention"] > 0
    assert sum(kinds.values()) == sum(p.numel() for p in model.parameters())
    assert len(find_routers(model)) == len(an.moe_layers) >= 1
    targets = resolve_targets(model, ["attention", "experts", "router"])
    assert any(p.endswith("experts.gate_up_proj") for p in targets.parameters)
    assert all(targets.matched[a] for a in ("attention", "experts", "router"))
    if "shared_experts" in kinds and _peft_remapped_leaves(model):  # PEFT: they are experts
        with pytest.raises(UserError, match="renames to fused routed-expert tensors"):
            resolve_targets(model, ["shared_experts"])
    elif "shared_experts" in kinds:
        assert resolve_targets(model, ["shared_experts"]).modules
    else:  # OLMoE has none: the request names what exists
        with pytest.raises(UserError, match="matches nothing"):
            resolve_targets(model, ["shared_experts"])


# ------------------------------------------------------------ the stages


# hybrid families (linear-attention / state-space layers, MiniMax's own cache class): the engine
# decodes them on the model's own cache, one sequence per forward
HYBRID = ("qwen3_next", "minimax", "jamba")


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_next", "minimax"]
                         + [pytest.param(f, marks=pytest.mark.slow) for f in NEW[1:] + HYBRID[2:]])
def test_new_family_through_the_stages_in_process(family, tmp_path):
    """convert -> plan -> finetune steps -> regress evaluation -> one served completion."""
    bench = _bench()
    data = _data(tmp_path)
    row = bench.run_family(family, tmp_path, data, f"sqlite:///{tmp_path}/mlflow.db", steps=2)
    assert bench.passed(row), row


def _data(root: Path) -> dict:
    from moeflow_testing.demo_data import make_dataset

    train, eval_ = make_dataset(root / "data", n_train=200, n_eval=20, seed=0)
    return {"train": train, "eval": eval_}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("family,dtype", [(f, "bfloat16") for f in NEW] + [("qwen3_moe", "float32")])
def test_demo_pipeline_on_new_families_every_stage_finished(family, dtype, tmp_path):
    """configs/demo.yaml pointed at the checkpoint, through run_pipeline on a local Ray."""
    bench = _bench()
    row = bench.run_family(family, tmp_path, _data(tmp_path), f"sqlite:///{tmp_path}/mlflow.db",
                           steps=3, full=True, dtype=dtype)
    assert bench.passed(row), row


@pytest.mark.slow
def test_family_matrix(tmp_path):
    bench = _bench()
    out = tmp_path / "families.md"
    assert bench.main(["--out", str(out), "--workdir", str(tmp_path / "w")]) == 0
    rows = json.loads((tmp_path / "w" / "rows.json").read_text())
    assert sum(bench.passed(r) for r in rows) >= 0.9 * len(rows), out.read_text()
