"""How a pipeline run fails, stops and resumes: a stage error is one line (with the traceback as
an artifact), a transient bind failure is retried, SIGTERM closes every run KILLED with exit 143
(the runs a stage opened below its own too),
and `resume` keeps the selection (--only/--from/--rerun) the run was started with."""

import signal
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from moeflow.core import tracking as T
from moeflow.core.config import validate
from tests.conftest import abcd_config, cli_env
from workflows.runner import run_pipeline

pytestmark = pytest.mark.integration


def _run(raw, **kw):
    return run_pipeline(validate(raw), stages={}, **kw)


def _child(uri, parent_id, stage, which=-1):
    client = MlflowClient(uri)
    runs = [r for r in T.child_runs(client, client.get_run(parent_id)) if r.data.tags[T.STAGE] == stage]
    return client, sorted(runs, key=lambda r: r.info.start_time)[which]


def test_stage_error_is_one_line_and_the_traceback_an_artifact(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["wordy"]
    out = _run(raw, use_cache=False)
    assert out.status == "FAILED"
    assert out.stages["wordy"].error == "RuntimeError: the first line says it"
    client, run = _child(out.tracking_uri, out.run_id, "wordy")
    assert run.data.tags[T.ERROR] == "RuntimeError: the first line says it"
    local = client.download_artifacts(run.info.run_id, "error.txt", str(tmp_path))
    text = open(local).read()
    assert "Traceback" in text and "detail detail" in text


def test_a_failed_stage_closes_the_runs_it_opened(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["nesty"]
    out = _run(raw, use_cache=False)
    assert out.status == "FAILED"
    client = MlflowClient(out.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FAILED"}  # parent, stage, nested
    assert client.get_run(out.run_id).data.tags[T.DRIVER] == T.driver_tag()  # what `status` checks


def test_a_transient_bind_failure_is_retried_once(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["bindy"]
    seen = []
    out = _run(raw, use_cache=False, on_event=lambda kind, st: seen.append((kind, st.note)))
    assert out.ok, out.stages["bindy"].error
    assert out.stages["bindy"].result == {"attempts_seen": 2} and out.stages["bindy"].attempts == 2
    warn = [note for kind, note in seen if kind == "warning"]
    assert warn and "cannot bind socket (Address already in use)" in warn[0], seen
    _, first = _child(out.tracking_uri, out.run_id, "bindy", 0)
    assert first.info.status == "FAILED" and first.data.tags[T.ERROR].startswith("[ALERT] (7)")


@pytest.mark.slow  # six pipeline runs
def test_resume_keeps_the_runs_rerun_and_only(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    assert _run(raw).ok  # b finished once: a cache entry another run could reuse
    rerun = _run(raw, rerun=("b",))
    assert rerun.stages["b"].state == "done"
    client, b = _child(rerun.tracking_uri, rerun.run_id, "b")
    client.set_terminated(b.info.run_id, "KILLED")  # its driver died during the rerun of b
    resumed = _run(raw, resume_run_id=rerun.run_id)
    assert resumed.stages["b"].state == "done", resumed.stages["b"]  # rerun again, not the old cache
    assert resumed.stages["a"].state == "reused"
    again = _run(raw, resume_run_id=rerun.run_id)  # this run's own finished rerun counts
    assert again.stages["b"].state == "reused" and again.stages["b"].run_id == resumed.stages["b"].run_id
    only = _run(raw, only=("c",))
    assert set(only.stages) == {"a", "b", "c"}
    assert set(_run(raw, resume_run_id=only.run_id).stages) == {"a", "b", "c"}  # not d


@pytest.mark.slow  # a `moeflow run` subprocess with its own Ray
def test_sigterm_closes_every_run_killed_and_exits_143(tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["slow"]
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen([sys.executable, "-m", "workflows.cli", "run", str(cfg)], cwd=tmp_path,
                            env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "nested run open" in line:  # the stage runs and its nested run exists
                break
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # say what it printed after the SIGTERM
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"`moeflow run` still running 120 s after SIGTERM; it printed: {out[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "Traceback" not in out and "*** SIG" not in out, out  # no Python or C++ stack dump
    assert "moeflow resume" in out
    client = MlflowClient(raw["tracking"]["uri"])
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert runs and {r.info.status for r in runs} == {"KILLED"}


def test_serve_proxys_bind_failure_counts_as_transient():
    """The demo's serving stage once failed on `RuntimeError: Failed to bind to address
    '127.0.0.1:37965'.` (Ray Serve's proxy, a port taken after it was chosen): retried as
    HAProxy's `cannot bind socket` is."""
    from workflows.execute import TRANSIENT_BIND

    error = "RuntimeError: Failed to bind to address '127.0.0.1:37965'."
    assert any(m in error for m in TRANSIENT_BIND)


def test_status_of_a_run_whose_driver_was_killed_says_so(tmp_path):
    from workflows.report import pipeline_status

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names no process now
    exp = client.create_experiment("t")
    host = T.driver_tag().rpartition(":")[0]
    killed = client.create_run(exp, tags={T.KIND: "pipeline", T.DRIVER: f"{host}:{dead.pid}"}).info.run_id
    alive = client.create_run(exp, tags={T.KIND: "pipeline", T.DRIVER: T.driver_tag()}).info.run_id
    hint = pipeline_status(client, killed)["hint"]
    assert f"driver ({host}:{dead.pid}) is gone" in hint and f"moeflow resume {killed}" in hint
    assert "hint" not in pipeline_status(client, alive)
