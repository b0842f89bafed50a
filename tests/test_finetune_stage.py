"""The finetune stage end to end on Ray Train (2 gloo workers) with MLflow (sqlite).

One real 2-worker run (module fixture) backs most checks: the PEFT adapter
loads on the ORIGINAL checkpoint and reproduces the trained model's logits,
only LoRA gradients are all-reduced, routing metrics + heatmap are in MLflow,
and the adapter is a registered model version deploy can download.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tasks.base import StageContext

PLAN = {"num_workers": 2, "tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1,
        "data_parallel": 2, "fsdp": 1, "mode": "lora"}


def make_assets(root: Path, family: str = "qwen3_moe") -> dict:
    """Original HF checkpoint, a re-saved ("converted") copy, and demo data."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeflow_testing.demo_data import make_dataset
    from moeflow_testing.tiny import build_debug_model

    original = build_debug_model(family, root / "original", dtype="float32",
                                 initializer_range=0.2)
    # stands in for the convert stage's output: same weights, another on-disk layout
    converted = root / "converted"
    AutoModelForCausalLM.from_pretrained(original).save_pretrained(converted,
                                                                   max_shard_size="300KB")
    AutoTokenizer.from_pretrained(original).save_pretrained(converted)
    train, eval_ = make_dataset(root / "data", n_train=160, n_eval=16, seed=0)
    return {"original": original, "converted": converted, "train": train, "eval": eval_}


def make_config(assets: dict, tmp: Path, **sections) -> object:
    raw = {"name": "fttest", "model": {"path": str(assets["original"]), "dtype": "float32"},
           "data": {"train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
                    "seq_len": 64},
           "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["attention"]},
           "optimizer": {"lr": 5e-3, "warmup_steps": 1},
           "finetune": {"max_steps": 6, "micro_batch_size": 2, "checkpoint_every": 3,
                        "max_eval_examples": 8},
           "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db"}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return validate(raw)


def make_ctx(cfg, assets: dict, out: Path, run_id=None, plan=PLAN) -> StageContext:
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(stage="finetune", config=cfg, out_dir=out, mlflow_run_id=run_id,
                        tracking_uri=cfg.tracking.uri,
                        inputs={"convert": {"output_dir": str(assets["converted"]),
                                            "manifest_sha256": "feed" * 16},
                                "plan": {"plan": dict(plan)}})


def start_run(uri: str, tmp: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("ft", artifact_location=str(tmp / "artifacts"))
    return client.create_run(exp).info.run_id


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("ft"))


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory, ray_local):
    from tasks.finetune import run

    tmp = tmp_path_factory.mktemp("run")
    cfg = make_config(assets, tmp)
    run_id = start_run(cfg.tracking.uri, tmp)
    record = run(make_ctx(cfg, assets, tmp / "out", run_id))
    return {"record": record, "run_id": run_id, "cfg": cfg, "tmp": tmp}


def test_adapter_loads_on_original_checkpoint_and_reproduces_logits(trained, assets):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = Path(trained["record"]["adapter_dir"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(assets["original"])
    base = AutoModelForCausalLM.from_pretrained(assets["original"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    probe = load_file(trained["record"]["probe_path"])
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits  # [1, S, V]
        with model.disable_adapter():
            base_logits = model(input_ids=probe["input_ids"]).logits  # [1, S, V]
    torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=1e-4)
    assert (base_logits - probe["logits"]).abs().max() > 1e-3  # the adapter changed something
    # the eval loss the 2 workers computed (rows split between them, sums all-reduced)
    # is the loss of the adapter over every eval row
    from transformers import AutoTokenizer

    from moeflow.training import data as D
    from moeflow.training import steps as T

    cfg = trained["cfg"]
    ds = D.build_dataset(cfg.data, AutoTokenizer.from_pretrained(assets["original"]), cfg.seed)
    want = T.eval_loss(model, ds.eval_rows, batch_size=4)
    assert trained["record"]["metrics"]["eval_loss"] == pytest.approx(want, rel=1e-4)


def test_only_lora_gradients_cross_the_wire(trained):
    m = trained["record"]["metrics"]
    assert m["comm_bytes_per_step"] == m["lora_bytes"]  # fp32 LoRA grads, one all-reduce
    assert m["lora_bytes"] < m["base_bytes"] / 10
    assert m["step"] == 6 and trained["record"]["num_workers"] == 2
    assert 0 <= m["base_exact_match"] <= 1 and "adapter_exact_match" in m and m["eval_loss"] > 0


def test_mlflow_has_curves_routing_heatmap_and_lineage(trained):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=trained["cfg"].tracking.uri)
    run_id = trained["run_id"]
    loss = client.get_metric_history(run_id, "train/loss")
    assert sorted(p.step for p in loss) == [1, 2, 3, 4, 5, 6]
    run = client.get_run(run_id)
    for key in ("routing/layer0/entropy", "routing/layer1/dead_fraction",
                "routing/layer0/max_over_mean", "comm/allreduce_bytes_per_step",
                "params/trainable", "params/base_bytes", "adapter_exact_match"):
        assert key in run.data.metrics, key
    arts = {a.path for a in client.list_artifacts(run_id, "routing")}
    assert "routing/heatmap.png" in arts and "routing/expert_load.json" in arts
    assert run.data.tags["moeflow.dataset_sha256"] == trained["record"]["dataset_sha256"]
    assert run.data.tags["moeflow.base_manifest_sha256"] == "feed" * 16


def test_adapter_is_a_registered_model_version(trained, tmp_path):
    import mlflow

    rec = trained["record"]
    assert rec["registered_model"] == "fttest-adapter" and rec["model_version"] == "1"
    mlflow.set_tracking_uri(trained["cfg"].tracking.uri)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{rec['registered_model']}/{rec['model_version']}",
        dst_path=str(tmp_path))
    assert (Path(local) / "adapter_model.safetensors").is_file()


def test_bad_data_line_refused_before_training(assets, tmp_path):
    from tasks.finetune import run

    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(assets["train"]).read_text().splitlines()[0] + "\n{\"prompt\": 1}\n")
    cfg = make_config(assets, tmp_path, data={"train_file": str(bad)})
    with pytest.raises(UserError, match=rf"{bad}:2: .*prompt"):
        run(make_ctx(cfg, assets, tmp_path / "out"))


@pytest.mark.parametrize("plan, lora, match", [
    ({"expert_parallel": 2, "num_workers": 2, "data_parallel": 1},
     {"target_modules": ["attention", "experts"]}, "expert LoRA on an EP-sharded"),
    ({}, {"target_modules": ["attention", "w9"]}, "'w9' matches nothing"),
    ({}, {"target_modules": ["experts"], "dropout": 0.1}, "lora.dropout"),
])
def test_unsupported_combinations_refused_up_front(assets, tmp_path, plan, lora, match):
    from tasks.finetune import run

    cfg = make_config(assets, tmp_path, **({"lora": lora} if lora else {}))
    with pytest.raises(UserError, match=match):
        run(make_ctx(cfg, assets, tmp_path / "out", plan={**PLAN, **plan}))
    assert not (tmp_path / "out" / "adapter").exists()


def test_finetune_trains_at_the_plans_shortened_seq_len():
    """The plan stage halves data.seq_len when no plan fits it (the reference config plans at
    16384 for 32768); finetune packs rows to what was planned, and says so once."""
    from moeflow.core.config import load_config
    from tasks.finetune import at_planned_seq_len
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "reference-2.8t.yaml", [])
    said = []
    short = at_planned_seq_len(cfg, {"seq_len": 16384, "hardware": "supernode-384"}, said.append)
    assert short.data.seq_len == 16384 and cfg.data.seq_len == 32768
    assert said == ["data.seq_len 32768 fits no plan on supernode-384: training at the planned "
                    "seq_len 16384"]
    assert at_planned_seq_len(cfg, {"seq_len": 32768}, said.append) is cfg and len(said) == 1
