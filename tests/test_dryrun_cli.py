"""`moeflow run CONFIG --dry-run [--json]` as users run it: a subprocess, a real MLflow store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
REFERENCE = str(REPO / "configs" / "reference-2.8t.yaml")
# the reference runs all eight stages at its size (a stage that does not fit is refused, exit 2:
# tests/test_dryrun_refuse_cli.py)
RUNNABLE = ["convert", "plan", "operators", "calibrate", "finetune", "regress", "serving", "deploy"]


def moeflow(args, tmp_path, timeout=300):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    return subprocess.run([sys.executable, "-m", "workflows.cli", *args], cwd=tmp_path,
                          env=cli_env(tmp_path, MLFLOW_TRACKING_URI=uri), capture_output=True,
                          text=True, timeout=timeout), uri


def test_json_dry_run_is_an_mlflow_run_with_the_table(tmp_path):
    proc, uri = moeflow(["run", REFERENCE, "--dry-run", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [s["stage"] for s in out["stages"]] == RUNNABLE and out["world"] == 384
    assert out["cost"] == pytest.approx(2.0 * out["device_hours"])
    assert not (tmp_path / "work").exists()  # nothing ran

    from moeflow.core import tracking as T

    client = T.client_for(uri)
    run = client.get_run(out["mlflow"]["run_id"])
    assert run.data.tags[T.KIND] == "dryrun" and run.info.status == "FINISHED"
    assert run.data.metrics["wall_s"] == pytest.approx(out["wall_s"])
    assert run.data.metrics["finetune.est_seconds"] > 0
    logged = json.loads(T.download_text(client, run.info.run_id, "dryrun.json"))
    assert [s["stage"] for s in logged["stages"]] == RUNNABLE
    table = T.download_text(client, run.info.run_id, "dryrun.txt")
    assert all(name in table for name in RUNNABLE) and "critical path" in table
    assert not T.pipeline_runs(client, None)  # `moeflow runs` lists pipelines, not dry runs


@pytest.mark.slow  # three CLI processes, two pricing the reference (the JSON dry run above stays default)
@pytest.mark.ci
def test_table_dry_run_and_a_failing_check(tmp_path):
    proc, _ = moeflow(["run", REFERENCE, "--dry-run"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in [*RUNNABLE, "pipeline", "booked", "critical path", "checks", "assumptions"]:
        assert name in proc.stdout
    demo = [f"model.path={REPO / 'assets' / 'demo-base'}", "data.train_file=missing.jsonl",
            "finetune.adapters={}", "estimate.storage_free_gb=0.000001"]
    proc, _ = moeflow(["run", str(REPO / "configs" / "demo.yaml"), "--dry-run",
                       *[a for o in demo for a in ("--set", o)]], tmp_path)
    assert proc.returncode == 1 and "FAIL" in proc.stdout and "space" in proc.stdout
    proc, _ = moeflow(["run", REFERENCE, "--json"], tmp_path)
    assert proc.returncode == 2 and "--json goes with --dry-run" in proc.stderr
