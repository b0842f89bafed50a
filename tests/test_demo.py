"""The whole demo pipeline, as `make demo` runs it (slow: every stage for real; `.ci/run` runs
it on every submission)."""

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import cli_env

EIGHT = {"convert", "plan", "operators", "calibrate", "finetune", "regress", "serving", "deploy"}

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.ci]


@pytest.mark.timeout(1500)  # 2-5 min on 2 quiet cores; a busy CI host gets room (limit 600 s)
def test_demo_pipeline_finishes_with_every_stage_finished(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "demo", "--workdir",
                           str(tmp_path / "demo")], cwd=tmp_path,
                          env=cli_env(tmp_path, MLFLOW_TRACKING_URI=uri),
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "moeflow ui" in proc.stdout
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("moeflow-demo")
    parents = client.search_runs([exp.experiment_id], "tags.`moeflow.kind` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    stages = {r.data.tags["moeflow.stage"]: r.info.status for r in children}
    assert stages == dict.fromkeys(EIGHT, "FINISHED"), stages
    # each stage's dry-run estimate beside what it measured, on the parent run
    metrics = parents[0].data.metrics
    for name in [*EIGHT, "pipeline"]:
        assert metrics[f"{name}.est_seconds"] > 0 and metrics[f"{name}.seconds"] > 0, name
    assert max(metrics[f"{n}.seconds"] for n in EIGHT) < metrics["pipeline.seconds"]
    # the pre-trained base: held-out perplexity far below uniform, hot experts
    regress, = [r for r in children if r.data.tags["moeflow.stage"] == "regress"]
    assert regress.data.metrics["base/heldout_ppl_ratio"] <= 0.5
    assert regress.data.metrics["base/max_expert_load_skew"] >= 1.5
