"""The `plan` stage (pure function, with and without MLflow) and `moeflow plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tasks.base import StageContext

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A converted-checkpoint dir as far as the planner cares: its config.json."""
    from moeflow_testing.tiny import debug_config

    d = tmp_path_factory.mktemp("tiny-qwen3")
    (d / "config.json").write_text(debug_config("qwen3_moe").to_json_string())
    return d


def _ctx(tmp_path: Path, model_dir: Path, **sections) -> StageContext:
    raw = {"model": {"path": "/nonexistent", "dtype": "float32"}, "hardware": "cpu-local",
           "data": {"seq_len": 64}, "lora": {"rank": 8}, **sections}
    out = tmp_path / "out"
    out.mkdir(parents=True)
    return StageContext(stage="plan", config=validate(raw),
                        inputs={"convert": {"output_dir": str(model_dir)}}, out_dir=out)


def test_stage_writes_plan_and_logs_to_mlflow(tmp_path, model_dir):
    import mlflow

    from tasks.plan import STAGE, run

    assert STAGE.after == ("convert",) and not STAGE.needs_model and "parallel" in STAGE.sections
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    exp = mlflow.create_experiment("plan-test", artifact_location=str(tmp_path / "artifacts"))
    with mlflow.start_run(experiment_id=exp) as active:
        result = run(_ctx(tmp_path, model_dir, parallel="auto"))
    plan = result["plan"]
    assert (plan["num_workers"], plan["data_parallel"], plan["tensor_parallel"]) == (2, 2, 1)
    for key in ("pipeline_parallel", "expert_parallel", "fsdp", "mode"):
        assert key in plan
    on_disk = json.loads(Path(result["plan_path"]).read_text())
    assert on_disk["planned_rank_bytes"] == plan["planned_rank_bytes"]
    assert on_disk["model"]["path"] == str(model_dir)  # convert's output wins over model.path
    client = mlflow.tracking.MlflowClient()
    names = {a.path for a in client.list_artifacts(active.info.run_id, "plan")}
    assert {"plan/plan.json", "plan/alternatives.json", "plan/memory_breakdown.png"} <= names
    metrics = client.get_run(active.info.run_id).data.metrics
    assert metrics["plan.num_workers"] == 2


def test_stage_without_mlflow_and_explicit_degrees(tmp_path, model_dir):
    from tasks.plan import run

    result = run(_ctx(tmp_path, model_dir, parallel={"expert_parallel": 2}))
    plan = result["plan"]
    assert (plan["expert_parallel"], plan["fsdp"], plan["data_parallel"]) == (2, 2, 2)
    assert Path(result["chart"]).stat().st_size > 1000
    # one rank holds half the experts and half of every other tensor: both halves sum to the model
    from moeflow.model.params import count_params, spec_from_path

    total = count_params(spec_from_path(model_dir)).total
    assert sum(plan["planned_rank_bytes"].values()) == 4 * total


def test_stage_rejects_infeasible_and_unrunnable_degrees(tmp_path, model_dir):
    from tasks.plan import run

    with pytest.raises(UserError, match="PEFT expert LoRA"):
        run(_ctx(tmp_path, model_dir, parallel={"expert_parallel": 2, "tensor_parallel": 1},
                 lora={"rank": 8, "target_modules": ["experts"]}))
    tiny_hw = tmp_path / "tiny-hw.yaml"
    spec = (ROOT / "cluster/hardware/cpu-local.yaml").read_text()
    tiny_hw.write_text(spec.replace("memory_per_device_gb: 12.8", "memory_per_device_gb: 0.0001")
                       .replace("runtime_overhead_gb: 1.5", "runtime_overhead_gb: 0"))
    with pytest.raises(UserError, match=r"needs \d+(\.\d+)? [KM]B per device, over the 100 KB device memory budget by"):
        run(_ctx(tmp_path / "b", model_dir, hardware=str(tiny_hw), parallel={"fsdp": 1}))


def _cli():
    from workflows.commands.plan import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # keep `plan` a sub-command
    return app


def test_cli_json_and_tables():
    runner = CliRunner()
    res = runner.invoke(_cli(), ["plan", "configs/models/mixtral-8x7b.json", "--hardware",
                                 "cluster/hardware/h100-80g-x8.yaml", "--mode", "lora", "--json"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)
    assert rec["num_workers"] == 8 and rec["model"]["family"] == "mixtral"
    res = runner.invoke(_cli(), ["plan", "qwen3-30b-a3b", "--hardware", "a100-80g-x8",
                                 "--mode", "inference", "--batch", "16"])
    assert res.exit_code == 0, res.output
    assert "best plan" in res.output and "why the other plans were rejected" in res.output


def test_cli_infeasible_says_smallest_hardware():
    res = CliRunner().invoke(_cli(), ["plan", "reference-2.8t", "--hardware", "h100-80g-x8",
                                      "--mode", "inference", "--json"])
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert out["feasible"] is False and out["smallest_hardware"]["devices"] >= 70
    assert "5631.2 GB" in out["message"]


def test_cli_bad_input_is_a_user_error():
    res = CliRunner().invoke(_cli(), ["plan", "no-such-model", "--hardware", "h100-80g-x8"])
    assert isinstance(res.exception, UserError) and "shipped model configs" in str(res.exception)
    res = CliRunner().invoke(_cli(), ["plan", "mixtral-8x7b", "--mode", "train"])
    assert isinstance(res.exception, UserError)
