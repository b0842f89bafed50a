"""A killed driver: SIGKILL to `moeflow run` during finetune, then `moeflow resume`.

convert and plan are reused, finetune continues from its last Ray Train
checkpoint (not step 0) in the out dir of the killed attempt, and says so on
the terminal. The same run checks the quiet terminal: no line of Ray's
internals at the default verbosity. (slow: real Ray, real training)
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import cli_env
from workflows.demo import DEMO_CONFIG, build_assets

pytestmark = [pytest.mark.slow, pytest.mark.integration]

# what Ray / Ray Train / transformers print when their output reaches the terminal
RAY_NOISE = ("pid=", "PlacementGroupCleaner", "State API", "Checkpoint successfully created",
             "Reporting training result", "FutureWarning", "Token authentication",
             "RayTrainWorker", "INFO ", "WARNING ", "Writing model shards")


def _newest_checkpoint_step(workdir: Path) -> int:
    from moeflow.training.driver import latest_checkpoint_step

    steps = [latest_checkpoint_step(d / "ray") for d in workdir.glob("*/finetune-*")]
    return max((s for s in steps if s is not None), default=0)


def _wait_workers_gone(workdir: Path, timeout: float = 60) -> None:
    """Until every Ray Train worker of the killed driver (its rank*.pid files) has exited."""
    pids = [int(p.read_text()) for p in workdir.glob("*/finetune-*/workers/rank*.pid")]
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"Ray Train workers {alive} outlived the killed driver by {timeout} s")


@pytest.mark.timeout(1800)
def test_sigkill_driver_during_finetune_then_resume(tmp_path):
    assets = build_assets(tmp_path / "demo")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["model"]["path"] = str(assets["model"])
    raw["data"].update(train_file=str(assets["train"]), eval_file=str(assets["eval"]))
    raw["finetune"].update(max_steps=100, checkpoint_every=20, adapters={})
    raw["stages"] = {"enabled": ["convert", "plan", "finetune"]}
    raw.update(workdir=str(tmp_path / "runs"), tracking={"uri": uri})
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = cli_env(tmp_path)
    driver = subprocess.Popen([sys.executable, "-m", "workflows.cli", "run", str(cfg), "--no-cache"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600
        while _newest_checkpoint_step(tmp_path / "runs") < 20:
            assert driver.poll() is None, driver.stdout.read()
            assert time.time() < deadline, "no finetune checkpoint within 600 s"
            time.sleep(0.5)
        driver.send_signal(signal.SIGKILL)
        first = driver.communicate(timeout=60)[0]
    finally:
        if driver.poll() is None:
            driver.kill()
    assert "finetune started" in first and "finetune done" not in first
    _wait_workers_gone(tmp_path / "runs")  # they train on until the killed driver's Ray is gone
    killed_at = _newest_checkpoint_step(tmp_path / "runs")
    client = MlflowClient(uri)
    parent = client.search_runs([client.get_experiment_by_name("moeflow-demo").experiment_id],
                                filter_string="tags.`moeflow.kind` = 'pipeline'")[0]
    assert parent.info.status == "RUNNING"  # nobody closed it: the driver died
    time.sleep(3)  # the killed driver's Ray (fate-shared with it) goes down

    second = subprocess.run([sys.executable, "-m", "workflows.cli", "resume", parent.info.run_id,
                             "--tracking-uri", uri], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=900)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "convert reused" in out and "plan reused" in out, out
    step = int(out.split("finetune: resuming from checkpoint at step ")[1].split()[0])
    assert 20 <= step <= killed_at and step % 20 == 0, out
    noisy = [line for line in (first + out).splitlines() if any(n in line for n in RAY_NOISE)]
    assert not noisy, noisy

    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                            "and tags.`moeflow.stage` = 'finetune'")
    by_status = {r.info.status: r for r in runs}
    assert set(by_status) == {"KILLED", "FINISHED"}  # the lost attempt closed on resume
    done = by_status["FINISHED"]
    assert done.data.tags["moeflow.out_dir"] == by_status["KILLED"].data.tags["moeflow.out_dir"]
    assert done.data.metrics["resumed_from_step"] == step
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    assert os.path.isfile(Path(done.data.tags["moeflow.out_dir"]) / "adapter" / "adapter_config.json")
