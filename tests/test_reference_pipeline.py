"""configs/reference-tiny.yaml through `moeflow run`: all eight stages on the reference-shape
model (remote code, MXFP4 experts, images), refused without the opt-in, and a modeling
file edited after convert refused by the next stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env

pytestmark = [pytest.mark.slow, pytest.mark.integration]
STAGES = {"convert", "plan", "operators", "calibrate", "finetune", "regress", "serving", "deploy"}


def _moeflow(tmp_path: Path, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    return subprocess.run([sys.executable, "-m", "workflows.cli", *args], cwd=REPO,
                          env=cli_env(tmp_path, MLFLOW_TRACKING_URI=uri), capture_output=True,
                          text=True, timeout=timeout)


def test_reference_tiny_runs_all_eight_stages(tmp_path):
    from mlflow import MlflowClient

    subprocess.run([sys.executable, "-m", "moeflow_testing.reference.build", str(tmp_path / "ref")],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    sets = [f"model.path={tmp_path / 'ref/model'}", f"workdir={tmp_path / 'runs'}",
            f"data.train_file={tmp_path / 'ref/data/train.jsonl'}",
            f"data.eval_file={tmp_path / 'ref/data/eval.jsonl'}"]
    args = ["run", "configs/reference-tiny.yaml"] + [a for s in sets for a in ("--set", s)]

    refused = _moeflow(tmp_path, *args, "--set", "model.trust_remote_code=false", timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "set model.trust_remote_code: true" in refused.stderr
    assert "started" not in refused.stdout  # refused before any stage

    proc = _moeflow(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("moeflow-reference")
    parent, = client.search_runs([exp.experiment_id], "tags.`moeflow.kind` = 'pipeline'")
    children = client.search_runs([exp.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert {r.data.tags["moeflow.stage"]: r.info.status for r in children} == dict.fromkeys(STAGES, "FINISHED")
    for run in children:  # each stage recorded the code it ran
        assert run.data.params["remote_code.modeling_refmoe.py"]
    regress, = [r for r in children if r.data.tags["moeflow.stage"] == "regress"]
    assert any(k.startswith("eval_base/image_colors") for k in regress.data.metrics), regress.data.metrics

    # the modeling file edited in convert's output: the next stage reading it refuses it, naming the file
    convert, = [r for r in children if r.data.tags["moeflow.stage"] == "convert"]
    converted = Path(convert.data.tags["moeflow.out_dir"]) / "converted"
    code = converted / "modeling_refmoe.py"
    code.write_text(code.read_text() + "\n# edited\n")
    again = _moeflow(tmp_path, *args, "--rerun", "operators", "--stages", "operators", timeout=600)
    assert again.returncode == 1
    assert "modeling_refmoe.py: remote code changed since convert" in again.stdout + again.stderr
    assert json.loads((converted / "remote_code.json").read_text())["modeling_refmoe.py"]
