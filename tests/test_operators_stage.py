"""The `operators` stage on checkpoints with skewed routing: the load profile from
router hooks, the expert permutation (same logits, load moved), group-limited
routing kept, the experts-kernel table, the stage with MLflow, finetune's pick."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tasks.base import StageContext
from tests.operators_assets import TEXTS, skewed_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return skewed_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen"))


def _logits(model_dir, texts=TEXTS):
    import torch
    from transformers import AutoTokenizer

    from moeflow.model.models import load_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return load_model(model_dir, torch.float32)(**tok(texts, return_tensors="pt", padding=True)).logits


def test_profile_counts_every_real_token_once(qwen):
    from moeflow.operators.profile import hot_experts, profile_local

    load = profile_local(str(qwen), TEXTS, batch_size=4)  # one padded batch
    counts = np.asarray(load["counts"])  # [L, E]
    assert counts.shape == (2, 8) and load["layers"] == [0, 1]
    assert (counts.sum(1) == load["tokens"] * 2).all()  # top-2, padding excluded
    assert all({0, 1} <= set(h) for h in hot_experts(counts))  # the skewed experts


def test_permutation_keeps_logits_and_spreads_the_load(qwen, tmp_path):
    from moeflow.checkpoint.digest import file_digests
    from moeflow.checkpoint.manifest import read_manifest
    from moeflow.operators.placement import apply_permutation, plan_permutation
    from moeflow.operators.profile import profile_local

    load = profile_local(str(qwen), TEXTS * 2)
    counts = np.asarray(load["counts"])
    plan = plan_permutation(counts, ep=2)
    assert plan["changed"] and min(plan["after"]) > max(plan["before"])
    res = apply_permutation(qwen, tmp_path / "placed", load["routers"], plan["perms"], {"ep": 2})
    before, after = _logits(qwen), _logits(res["model_path"])
    assert float((before - after).abs().max()) < 1e-5  # same function (softmax order aside)
    assert (before.argmax(-1) == after.argmax(-1)).all()
    moved = np.asarray(profile_local(res["model_path"], TEXTS * 2)["counts"])
    assert (moved == np.take_along_axis(counts, np.asarray(plan["perms"]), 1)).all()
    manifest = read_manifest(res["model_path"])
    assert manifest["placement"]["ep"] == 2 and manifest["placement"]["kind"] == "permutation"
    for name in {e["file"] for e in manifest["tensors"].values()}:
        for tensor, digest in file_digests(Path(res["model_path"]) / name, manifest["checksum"]).items():
            assert manifest["tensors"][tensor][manifest["checksum"]] == digest


def test_group_limited_routing_moves_experts_only_inside_groups(tmp_path):
    import torch
    from safetensors import safe_open

    from moeflow.operators.placement import apply_permutation, plan_permutation, routing_groups
    from moeflow.operators.profile import profile_local

    ds = skewed_checkpoint("deepseek_v3", tmp_path, strength=1.0)
    config = json.loads((ds / "config.json").read_text())
    assert routing_groups(config) == 2  # n_group 2, topk_group 1
    load = profile_local(str(ds), TEXTS * 2)
    plan = plan_permutation(np.asarray(load["counts"]), ep=4, groups=2)
    perms = np.asarray(plan["perms"])
    assert plan["changed"] and (perms[:, :4] < 4).all() and (perms[:, 4:] >= 4).all()
    res = apply_permutation(ds, tmp_path / "placed", load["routers"], plan["perms"], {"ep": 4})
    before, after = _logits(ds), _logits(res["model_path"])
    assert float((before - after).abs().max()) < 1e-5
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    files = json.loads((ds / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(ds / files[key]), "pt") as a, safe_open(str(Path(res["model_path"]) / files[key]), "pt") as b:
        assert torch.equal(b.get_tensor(key), a.get_tensor(key)[torch.from_numpy(perms[0])])


def test_experts_implementations_table():
    from moeflow.operators.opbench import bench_block
    from moeflow_testing.tiny import debug_config

    res = bench_block(debug_config("qwen3_moe"), tokens=32, dtype="float32", lora_rank=4, reps=1)
    rows = {r["implementation"]: r for r in res["rows"]}
    assert all(rows[i]["available"] and rows[i]["train_s"] > 0 for i in ("eager", "grouped_mm", "batched_mm"))
    assert not rows["deepgemm"]["available"] and "GPU" in rows["deepgemm"]["reason"]
    fastest = min((r for r in rows.values() if r["available"]), key=lambda r: r["train_s"])
    assert res["chosen"]["training"] == fastest["implementation"]
    assert rows[res["chosen"]["serving"]]["forward_s"] <= rows["eager"]["forward_s"]
    assert res["shape"] == {"hidden": 64, "intermediate": 32, "experts": 8, "top_k": 2,
                            "fused_gate_up": True, "experts_built": 8}


def _ctx(tmp_path: Path, model_dir: Path, **operators) -> StageContext:
    raw = {"model": {"path": str(model_dir), "dtype": "float32"}, "hardware": "cpu-local",
           "lora": {"rank": 4, "target_modules": ["attention", "experts"]},
           "operators": {"ep_size": 2, "num_redundant_experts": 2, "bench_tokens": 32, "bench_reps": 1,
                         "dispatch": False, **operators}}
    out = tmp_path / "out"
    out.mkdir(parents=True)
    plan = {"plan": {"expert_parallel": 1, "tensor_parallel": 1}}
    return StageContext(stage="operators", config=validate(raw),
                        inputs={"convert": {"output_dir": str(model_dir)}, "plan": plan}, out_dir=out)


def test_stage_record_files_and_mlflow(qwen, tmp_path, mlflow_uri):
    import mlflow

    from tasks.operators import STAGE, run

    assert STAGE.upstream == ("convert", "plan")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS * 3))
    mlflow.set_tracking_uri(mlflow_uri)
    exp = mlflow.create_experiment("operators-test", artifact_location=str(tmp_path / "artifacts"))
    with mlflow.start_run(experiment_id=exp) as active:
        rec = run(_ctx(tmp_path, qwen, calibration_file=str(calib)))
    assert rec["placement_applied"] and Path(rec["model_path"], "manifest.json").is_file()
    assert rec["ep_size"] == 2 and rec["balancedness_after"] > rec["balancedness_before"]
    ops = json.loads(Path(rec["operators_path"]).read_text())
    assert ops["experts_implementation"] == rec["experts_implementation"]
    assert ops["experts"]["lora_rank"] == 4  # lora targets experts: timed with expert LoRA
    assert ops["placement"]["engines"]["vllm"]["args"][0] == "--enable-eplb"
    sglang = json.loads(Path(ops["placement"]["engines"]["sglang"]["file"]).read_text())
    assert np.asarray(sglang["physical_to_logical_map"]).shape == (2, 10)
    assert ops["kv_cache"]["bytes_per_token"] > 0
    load = json.loads(Path(rec["load_path"]).read_text())
    assert load["texts"] == 12 and len(load["counts"]) == 2
    client = mlflow.tracking.MlflowClient()
    names = {a.path for a in client.list_artifacts(active.info.run_id, "operators")}
    assert {"operators/operators.json", "operators/expert_load.json", "operators/expert_load.png",
            "operators/placement.json"} <= names
    data = client.get_run(active.info.run_id).data
    assert data.params["experts_implementation.training"] == rec["experts_implementation"]["training"]
    history = client.get_metric_history(active.info.run_id, "balancedness_after")
    assert sorted(m.step for m in history) == [0, 1]


def test_default_calibration_is_the_golden_suite_and_bad_input_fails(qwen, tmp_path):
    from moeflow.operators.profile import calibration_texts
    from tasks.operators import STAGE

    texts, source = calibration_texts(None)
    assert "golden" in source and any(t.startswith("reverse:") for t in texts)
    cfg = validate({"model": {"path": "x"}, "operators": {"calibration_file": "/nonexistent.jsonl"}})
    with pytest.raises(UserError, match="nonexistent.jsonl"):
        STAGE.preflight(cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"label": 3}\n')
    with pytest.raises(UserError, match="bad.jsonl:2"):
        calibration_texts(str(bad))
    cfg = validate({"model": {"path": str(qwen)}, "operators": {"ep_size": 3, "num_redundant_experts": 2}})
    with pytest.raises(UserError, match="ep_size 3 does not divide experts . redundant = 8 . 2"):
        STAGE.preflight(cfg)


def test_finetune_takes_the_training_choice(tmp_path):
    from tasks.finetune import STAGE, _experts_impl

    assert "operators" in STAGE.after  # an optional edge: finetune runs after it when it is enabled
    ctx = StageContext(stage="finetune", config=validate({"model": {"path": "x"}}), out_dir=tmp_path,
                       inputs={"operators": {"experts_implementation": {"training": "eager",
                                                                        "serving": "grouped_mm"}}})
    assert _experts_impl(ctx) == "eager"


@pytest.mark.integration
def test_profile_shards_over_ray_tasks(qwen, ray_local):
    from moeflow.operators.profile import profile, profile_local

    texts = TEXTS * 3
    sharded = profile(str(qwen), texts, shard_size=4, batch_size=4)
    assert sharded["shards"] == 3
    assert sharded["counts"] == profile_local(str(qwen), texts, batch_size=4)["counts"]


@pytest.mark.slow
def test_ep2_rank_load_drops_under_transformers_ep(qwen, tmp_path):
    """Load at EP 2 over gloo with DistributedConfig, count each rank's routed pairs."""
    from moeflow.operators.dist import dispatch_bench, ep_rank_load
    from moeflow.operators.placement import apply_permutation, plan_permutation
    from moeflow.operators.profile import profile_local

    load = profile_local(str(qwen), TEXTS * 2)
    plan = plan_permutation(np.asarray(load["counts"]), ep=2)
    res = apply_permutation(qwen, tmp_path / "placed", load["routers"], plan["perms"], {"ep": 2})
    before = ep_rank_load(str(qwen), TEXTS * 2, 2)
    after = ep_rank_load(res["model_path"], TEXTS * 2, 2)
    assert sum(before["per_rank"]) == sum(after["per_rank"])
    assert after["max_over_mean"] < before["max_over_mean"]
    moved = dispatch_bench(64, 32, 8, 2, "float32", iters=2)
    assert moved["all_to_all"]["bytes"] < moved["all_gather"]["bytes"]
