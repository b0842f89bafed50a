"""The real pipeline fails in a middle stage on bad input, then resumes.

convert -> plan -> operators -> calibrate -> finetune -> regress -> serving -> deploy (the
demo's DAG; operators, calibrate and serving are optional edges, StageSpec.after), where the
regression suite has a corrupt JSONL line (operators and calibrate read the shipped golden
suite, not this copy): regress fails naming file and line, serving and deploy are skipped;
after fixing the file, `moeflow resume` reruns only regress, serving and deploy, reusing the
same child runs of the stages before. (slow: every stage for real)
"""

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from moeflow.core import tracking as T
from tests.conftest import REPO, cli_env
from workflows.demo import DEMO_CONFIG, build_assets

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.ci]


def test_middle_stage_failure_then_resume(tmp_path):
    assets = build_assets(tmp_path / "demo")
    shutil.copytree(REPO / "configs" / "suites", tmp_path / "suites")
    bad = tmp_path / "suites" / "golden" / "plain_text.jsonl"
    good_text = bad.read_text()
    bad.write_text(good_text + "{not json\n")
    bad_line = len(good_text.splitlines()) + 1
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["model"]["path"] = str(assets["model"])
    raw["data"].update(train_file=str(assets["train"]), eval_file=str(assets["eval"]))
    raw["finetune"]["adapters"]["reverse"].update(train_file=str(assets["train_reverse"]),
                                                  eval_file=str(assets["eval_reverse"]))
    raw["workdir"] = str(tmp_path / "runs")
    raw["tracking"] = {"uri": uri}
    raw["regress"]["suite"] = str(tmp_path / "suites" / "golden.yaml")  # the demo's gate otherwise
    raw.setdefault("deploy", {})["port"] = 0
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = cli_env(tmp_path)

    def moeflow(*args):
        return subprocess.run([sys.executable, "-m", "workflows.cli", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=900)

    first = moeflow("run", str(cfg), "--no-cache")
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"plain_text.jsonl:{bad_line}" in first.stdout
    run_id = first.stdout.split("moeflow resume ")[1].split()[0]
    client = MlflowClient(uri)
    status = json.loads(moeflow("status", run_id, "--json", "--tracking-uri", uri).stdout)
    states = {s["name"]: s["state"] for s in status["stages"]}
    assert states == {"convert": "done", "plan": "done", "operators": "done", "calibrate": "done",
                      "finetune": "done", "regress": "failed", "serving": "skipped",
                      "deploy": "skipped"}
    before = {s["name"]: s["run_id"] for s in status["stages"]}

    bad.write_text(good_text)  # fix the input
    second = moeflow("resume", run_id, "--tracking-uri", uri)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    status = json.loads(moeflow("status", run_id, "--json", "--tracking-uri", uri).stdout)
    assert status["status"] == "FINISHED"
    by_name = {s["name"]: s for s in status["stages"]}
    for name in ("convert", "plan", "operators", "calibrate", "finetune"):
        assert by_name[name]["state"] == "reused"
        assert by_name[name]["run_id"] == before[name], "reused stages keep their child run"
        assert by_name[name]["attempts"] == 1, f"{name} was not executed again"
    assert by_name["regress"]["state"] == "done" and by_name["regress"]["attempts"] == 2
    assert by_name["serving"]["state"] == "done" and by_name["serving"]["attempts"] == 1
    assert by_name["deploy"]["state"] == "done" and by_name["deploy"]["attempts"] == 1
    children = T.child_runs(client, client.get_run(run_id))
    assert children and all(r.info.status in ("FINISHED", "FAILED") for r in children)
