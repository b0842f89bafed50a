"""Stage `calibrate`: the pure function inside an MLflow run, the precision plan, hand-offs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tasks.base import StageContext
from tests.quant_assets import edited, outliers, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(tmp_path: Path, model: Path, **calibrate) -> dict:
    return {"name": "cal", "experiment": "cal", "workdir": str(tmp_path / "work"),
            "model": {"path": str(model), "dtype": "float32"},
            "calibrate": {"samples": 12, "min_top1_agreement": 0.8, **calibrate}}


def _ctx(tmp_path: Path, model: Path, **calibrate) -> StageContext:
    out = tmp_path / "out"
    out.mkdir()
    return StageContext(stage="calibrate", config=validate(_cfg(tmp_path, model, **calibrate)),
                        inputs={"convert": {"output_dir": str(model)}}, out_dir=out)


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    """A checkpoint whose layer-1 o_proj no 8-bit per-channel scale survives."""
    return edited(tiny("qwen3_moe"), tmp_path_factory.mktemp("fragile") / "model",
                  "model.layers.1.self_attn.o_proj.weight", outliers())


def test_stage_names_the_fragile_layer(tmp_path, fragile):
    """The baseline's layer-1 attention cannot take 8-bit weights: the report names it, even
    though its huge outputs keep the final logits (and so the end-to-end check) intact."""
    from tasks.calibrate import run

    ctx = _ctx(tmp_path, fragile)
    record = run(ctx)
    report = json.loads(Path(record["report_path"]).read_text())
    assert record["first_divergent"] == report["first_divergent"] == "model.layers.1.self_attn"
    rows = {r["name"]: r for r in report["layers"]}
    assert rows["model.layers.1.self_attn"]["status"] == "error"
    assert rows["model.layers.0.self_attn"]["status"] != "error"
    assert (ctx.out_dir / "table.txt").read_text().startswith("first divergent layer: "
                                                              "model.layers.1.self_attn")


def test_precision_plan_returns_modules_until_the_check_holds_and_logs_to_mlflow(tmp_path,
                                                                                  mlflow_uri):
    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from tasks.calibrate import run

    # a random tiny model's top-2 tokens are near ties almost everywhere (flat logits): with
    # ties excused fp8 alone holds, so the plan is exercised under the strict rule (no ties)
    ctx = _ctx(tmp_path, tiny("qwen3_moe"), min_top1_agreement=0.99, tie_margin=0.0)
    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.set_experiment("cal")
    with mlflow.start_run() as active:
        record = run(ctx)
    report = json.loads(Path(record["report_path"]).read_text())
    plan = report["precision_plan"]
    assert record["scheme"] == "fp8" and record["native_load"] is True
    assert plan["added"] and plan["holds"] and report["final"]["top1_agreement"] >= 0.99
    assert plan["steps"][0]["final"]["top1_agreement"] < 0.99  # fp8 alone did not hold
    assert record["precision_plan"]["ignore"] == plan["ignore"]
    assert set(report["layers"][0]) >= {"name", "kind", "cosine", "max_abs", "max_rel",
                                        "router_topk_overlap", "status"}
    # the plan is written into the checkpoint: the returned modules have no scales
    ckpt = Path(record["checkpoint"])
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["ignore"] == plan["ignore"]
    names = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    returned = plan["added"][0]
    assert not any(n.startswith(returned + ".") and n.endswith("weight_scale") for n in names)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
    arts = {a.path for a in MlflowClient(mlflow_uri).list_artifacts(active.info.run_id, "calibrate")}
    assert arts == {"calibrate/report.json", "calibrate/table.txt", "calibrate/layers.png"}


def test_a_check_that_cannot_hold_fails_the_stage_with_the_report_written(tmp_path):
    from tasks.calibrate import run

    ctx = _ctx(tmp_path, tiny("qwen3_moe"), min_top1_agreement=0.99, max_plan_steps=0,
               tie_margin=0.0)  # strict, as above
    with pytest.raises(UserError, match=r"end-to-end check not met after 0 plan rounds"):
        run(ctx)
    assert json.loads((ctx.out_dir / "report.json").read_text())["precision_plan"]["holds"] is False


def test_preflight_and_handoffs(tmp_path):
    from moeflow.serving.deployment import calibrated_checkpoint
    from tasks.calibrate import STAGE
    from tasks.plan import workload_from_config

    assert STAGE.upstream == ("convert", "plan")
    with pytest.raises(UserError, match="fp8-block is not loadable by transformers"):
        calibrated_checkpoint({"checkpoint": "x", "scheme": "fp8-block"})
    with pytest.raises(UserError, match="needs the calibrate stage"):
        calibrated_checkpoint(None)
    assert calibrated_checkpoint({"checkpoint": "/q", "scheme": "w8a16"}) == "/q"
    cfg = _cfg(tmp_path, tiny("qwen3_moe"), scheme="w8a16")
    cfg.update(plan={"mode": "inference"}, deploy={"weights": "calibrated"})
    assert workload_from_config(validate(cfg)).weight_dtype == "int8"
    cfg["deploy"]["weights"] = "converted"
    assert workload_from_config(validate(cfg)).weight_dtype == "fp32"
    with pytest.raises(UserError, match="calibrate.scheme"):
        validate(_cfg(tmp_path, tiny("qwen3_moe"), scheme="fp4"))


@pytest.mark.slow
def test_calibrate_runs_in_the_pipeline_on_the_demo_model(tmp_path):
    """`moeflow calibrate configs/demo.yaml` (convert -> plan -> calibrate) on the demo model;
    the calibrate MLflow run holds report, table and plot."""
    import subprocess

    from mlflow.tracking import MlflowClient

    from tests.conftest import BIN, REPO, cli_env
    from workflows.demo import build_assets

    build_assets(tmp_path / "demo-work")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    res = subprocess.run([str(BIN / "moeflow"), "calibrate", str(REPO / "configs/demo.yaml"),
                          "--set", f"model.path={tmp_path}/demo-work/model",
                          "--set", f"workdir={tmp_path}/runs", "--set", f"tracking.uri={uri}"],
                         capture_output=True, text=True, env=cli_env(tmp_path), timeout=900,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("moeflow-demo").experiment_id],
                              "tags.`moeflow.stage` = 'calibrate'")
    arts = {a.path for a in client.list_artifacts(runs[0].info.run_id, "calibrate")}
    assert arts == {"calibrate/report.json", "calibrate/table.txt", "calibrate/layers.png"}
