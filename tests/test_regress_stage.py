"""Stage `regress`: the pure function with MLflow, and in the DAG on Ray (stops deploy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tasks.base import StageContext, StageSpec
from tasks.regress import STAGE
from tests.eval_assets import assets, run_regress_in_mlflow

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def uri(mlflow_uri):
    return mlflow_uri


def _config(tmp_path: Path, uri: str, **regress) -> dict:
    return {"name": "regress-test", "experiment": "regress-test", "workdir": str(tmp_path / "work"),
            "model": {"path": str(assets()["base"]), "dtype": "float32"},
            "tracking": {"uri": uri}, "regress": {"shards": 1, **regress}}


def _ctx(tmp_path: Path, uri: str, adapter: str, **regress) -> StageContext:
    out = tmp_path / "out"
    out.mkdir()
    inputs = {"convert": {"output_dir": str(assets()["base"]), "manifest_sha256": "m" * 64},
              "finetune": {"adapter_dir": str(assets()[adapter])}}
    return StageContext(stage="regress", config=validate(_config(tmp_path, uri, **regress)),
                        inputs=inputs, out_dir=out, tracking_uri=uri)


def _in_run(uri: str, ctx: StageContext):
    return run_regress_in_mlflow(uri, "regress-test", ctx)


def test_good_adapter_passes_and_records_a_baseline(tmp_path, uri, capsys):
    result, run_id = _in_run(uri, _ctx(tmp_path, uri, "good", record_baseline="stage-v1"))
    assert isinstance(result, dict), result
    assert result["passed"] is True and Path(result["results_path"]).is_file()
    assert result["manifest_sha256"] == "m" * 64 and len(result["adapter_sha256"]) == 64
    assert result["metrics"]["eval/reverse_nll/bits_per_byte"] < \
        result["base_metrics"]["eval_base/reverse_nll/bits_per_byte"]
    run_ = MlflowClient(uri).get_run(run_id)
    assert run_.data.tags["moeflow.baseline"] == "stage-v1"
    assert "eval/plain_text/bits_per_byte" in run_.data.metrics
    assert "eval_base/plain_text/bits_per_byte" in run_.data.metrics
    assert "adapter vs base" in capsys.readouterr().out
    assert STAGE.upstream == ("convert", "finetune") and STAGE.after == ("calibrate", "operators") and STAGE.sections == ("model", "regress")


def test_random_adapter_fails_against_base_and_baseline(tmp_path, uri):
    # after the good adapter's baseline (previous test), the latest for this suite is found by hash
    err, run_id = _in_run(uri, _ctx(tmp_path, uri, "random"))
    assert isinstance(err, UserError), err
    message = str(err)
    assert "regressed vs base: reverse_nll/bits_per_byte" in message
    assert "regressed vs baseline 'stage-v1'" in message and "plain_text/bits_per_byte" in message
    table = (tmp_path / "out" / "comparison.txt").read_text()
    assert "fine-tune target: must improve" in table and "FAIL" in table
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["passed"] is False
    assert "regress/comparison.txt" in [a.path for a in
                                        MlflowClient(uri).list_artifacts(run_id, "regress")]


def test_models_are_evaluated_with_the_operators_stages_serving_kernel(tmp_path, uri, monkeypatch):
    """regress loads every model with the experts kernel they will be served with."""
    from moeflow.evaluation import runners

    used = []
    init = runners.HFRunner.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        used.append(self.model.config._experts_implementation)
    monkeypatch.setattr(runners.HFRunner, "__init__", spy)
    ctx = _ctx(tmp_path, uri, "good")
    ctx.inputs["operators"] = {"experts_implementation": {"training": "grouped_mm", "serving": "eager"}}
    result, _ = _in_run(uri, ctx)
    assert isinstance(result, dict), result
    assert used and set(used) == {"eager"}
    results = json.loads(Path(result["results_path"]).read_text())
    assert {m["settings"]["experts_implementation"] for m in results["models"].values()} == {"eager"}


def test_named_baseline_missing_is_an_error(tmp_path, uri):
    err, _ = _in_run(uri, _ctx(tmp_path, uri, "good", baseline="never-recorded"))
    assert isinstance(err, UserError) and "no baseline named 'never-recorded'" in str(err)


# ---------------------------------------------------------------- in the DAG


def _fake_convert(ctx):
    return {"output_dir": ctx.config.model.path, "manifest_sha256": "c" * 64,
            "family": "qwen3_moe", "source_dir": ctx.config.model.path}


def _fake_finetune(ctx):
    # test convention: data.train_file names the adapter this "fine-tune" produced
    return {"adapter_dir": ctx.config.data.train_file, "adapter_name": "t",
            "registered_model": None, "model_version": None,
            "base_dir": ctx.input("convert")["output_dir"], "metrics": {}}


def _fake_deploy(ctx):
    return {"url": "http://127.0.0.1:1", "models": ["t"], "smoke": {}}


STAGES = {
    "convert": StageSpec(name="convert", run=_fake_convert, sections=("model",)),
    "finetune": StageSpec(name="finetune", run=_fake_finetune, upstream=("convert",),
                          sections=("data",)),
    "regress": STAGE,
    "deploy": StageSpec(name="deploy", run=_fake_deploy,
                        upstream=("convert", "finetune", "regress")),
}


@pytest.mark.integration
def test_regression_stops_the_dag_before_deploy(ray_local, tmp_path):
    from workflows.runner import run_pipeline

    raw = _config(tmp_path, f"sqlite:///{tmp_path}/mlflow.db")
    raw["data"] = {"train_file": str(assets()["random"])}
    out = run_pipeline(validate(raw), stages=STAGES, use_cache=False)
    states = {name: s.state for name, s in out.stages.items()}
    assert out.status == "FAILED"
    assert states == {"convert": "done", "finetune": "done", "regress": "failed",
                      "deploy": "skipped"}, {n: s.error for n, s in out.stages.items()}
    assert "regressed vs base" in out.stages["regress"].error
