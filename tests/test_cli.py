"""The `moeflow` CLI as users run it: subprocesses, real Ray, MLflow, HTTP."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import abcd_config, cli_env, free_port

pytestmark = pytest.mark.integration


def moeflow(args, tmp_path, timeout=300):
    return subprocess.run([sys.executable, "-m", "workflows.cli", *args], cwd=tmp_path,
                          env=cli_env(tmp_path), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # 6 min in a full default run (a pipeline run, resumed, in CLI processes)
@pytest.mark.ci
def test_run_fail_resume_status_runs(tmp_path):
    raw = abcd_config(tmp_path, lines="good\nbad\n")
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    uri = raw["tracking"]["uri"]
    proc = moeflow(["run", str(cfg), "--no-cache"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "train.jsonl:2: bad line" in proc.stdout and "skipped" in proc.stdout
    run_id = proc.stdout.split("moeflow resume ")[1].split()[0]

    (tmp_path / "train.jsonl").write_text("good\n")
    proc = moeflow(["resume", run_id, "--tracking-uri", uri], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Downloading artifacts" not in proc.stdout + proc.stderr  # quiet by default
    proc = moeflow(["status", run_id, "--json", "--tracking-uri", uri], tmp_path)
    info = json.loads(proc.stdout)
    assert info["run_id"] == run_id and info["status"] == "FINISHED"
    assert [s["name"] for s in info["stages"]] == ["a", "b", "c", "d"]
    for s in info["stages"]:
        assert set(s) == {"name", "state", "run_id", "attempts", "seconds"}
        assert s["state"] in {"done", "reused"} and s["seconds"] is not None
    proc = moeflow(["runs", "--tracking-uri", uri], tmp_path)
    assert run_id in proc.stdout and "FINISHED" in proc.stdout
    proc = moeflow(["resume", run_id, "--tracking-uri", uri], tmp_path)  # a finished run: nothing runs
    assert proc.returncode == 0 and f"run {run_id} finished: nothing to resume" in proc.stdout, proc.stdout
    again = json.loads(moeflow(["status", run_id, "--json", "--tracking-uri", uri], tmp_path).stdout)
    assert again["stages"] == info["stages"]
    proc = moeflow(["status", "nope", "--tracking-uri", uri], tmp_path)
    assert proc.returncode == 2 and "no MLflow run 'nope'" in proc.stderr


@pytest.mark.slow  # ~50 s of the default suite on 2 cores (a `moeflow run` on its own Ray, interrupted)
@pytest.mark.ci
def test_ctrl_c_leaves_no_run_running(tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["slow"]
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    # SIGINT's default disposition, restored in the child: a suite started from a
    # background job (`cmd &`) inherits SIGINT ignored, and the driver rightly honours that
    proc = subprocess.Popen([sys.executable, "-m", "workflows.cli", "run", str(cfg)],
                            cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if "nested run open" in line:  # the stage runs and its nested run exists
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    client = MlflowClient(raw["tracking"]["uri"])
    exp = client.get_experiment_by_name("tests")
    runs = client.search_runs([exp.experiment_id])
    assert runs and all(r.info.status != "RUNNING" for r in runs)
    assert {r.info.status for r in runs} == {"KILLED"}


def test_ui_serves_the_local_store(tmp_path):
    port = free_port()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = subprocess.Popen([sys.executable, "-m", "workflows.cli", "ui", "--port", str(port),
                             "--tracking-uri", uri], cwd=tmp_path, env=cli_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline, body = time.time() + 300, ""
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    body = r.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        assert body.strip() == "OK"
    finally:
        import os

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.slow  # ~65 s of the default suite on 2 cores (two `moeflow run`s, each on its own Ray)
@pytest.mark.ci
def test_quiet_by_default_everything_with_v(tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["noisy"]
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    quiet = moeflow(["run", str(cfg), "--no-cache"], tmp_path)
    out = quiet.stdout + quiet.stderr
    assert quiet.returncode == 0, out
    assert "noisy: the one line the user needs" in out and "noisy: pieces 2/2" in out
    assert "NOISE-from-worker" not in out and "pid=" not in out and "Warning" not in out, out
    loud = moeflow(["run", str(cfg), "--no-cache", "-v"], tmp_path)
    assert loud.returncode == 0, loud.stdout + loud.stderr
    assert "NOISE-from-worker stdout" in loud.stdout + loud.stderr


def test_tables_fit_80_columns_without_breaking_words():
    from rich.console import Console

    from workflows import report
    from workflows.outcome import StageState

    rid = "0123456789abcdef0123456789abcdef"
    states = {n: StageState(name=n, state=s, run_id=rid, attempts=1, seconds=12.3,
                            error="upstream convert failed" if s == "skipped" else None)
              for n, s in [("convert", "done"), ("plan", "reused"), ("operators", "failed"),
                           ("finetune", "skipped"), ("calibrate", "skipped")]}
    console = Console(width=80, record=True, color_system=None)
    console.print(report.stage_table(states, title=f"pipeline run {rid}"))
    run = type("R", (), {})()
    run.info = type("I", (), {"run_id": rid, "run_name": "demo-experts", "status": "FINISHED",
                              "start_time": 1_700_000_000_000})()
    run.data = type("D", (), {"tags": {"moeflow.stages": "convert,plan,finetune,regress",
                                       **{f"moeflow.state.{n}": "done" for n in
                                          ("regress", "convert", "finetune", "plan")}}})()
    console.print(report.runs_table([run]))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for word in (rid, "convert", "operators", "finetune", "calibrate", "upstream", "reused"):
        assert word in text, (word, text)
    runs_lines = text[text.index("pipeline runs"):].splitlines()
    order = [w for line in runs_lines for w in ("convert", "plan", "finetune", "regress")
             if f"{w} done" in line]
    assert order == ["convert", "plan", "finetune", "regress"]  # DAG order, not alphabetical


def test_ray_error_channel_is_quiet_by_default(monkeypatch, capsys):
    import ray._private.worker as rw

    from workflows.verbosity import quiet_ray_errors

    monkeypatch.delenv("MOEFLOW_VERBOSE", raising=False)
    monkeypatch.setattr(rw, "print_to_stdstream", rw.print_to_stdstream)  # restored after the test
    quiet_ray_errors()
    rw.print_to_stdstream({"lines": ["Task X failed. There are infinite retries remaining"],
                           "pid": "raylet", "is_err": False})
    rw.print_to_stdstream({"lines": ["a worker's own line"], "pid": 123, "is_err": False,
                           "ip": "127.0.0.1", "job": "01", "actor_name": "", "task_name": ""})
    out = capsys.readouterr()
    assert "infinite retries" not in out.out + out.err
    assert "a worker's own line" in out.out + out.err


def test_a_user_error_is_one_line_and_its_cause_shows_with_verbose(monkeypatch, capsys):
    """A UserError raised from a library failure (Ray Serve not starting) is one line; `-v` adds
    the library's own error above it."""
    from moeflow.core.errors import UserError
    from workflows import cli

    def failing(**_):
        try:
            raise RuntimeError("HAProxy crashed during startup")
        except RuntimeError as exc:
            raise UserError("Ray Serve did not start the app") from exc

    monkeypatch.setattr(cli, "app", failing)
    monkeypatch.setattr("workflows.commands.register_all", lambda app: None)
    monkeypatch.setattr("workflows.verbosity.configure", lambda: None)  # no process-wide quieting here
    for argv, shows_cause in ((["moeflow", "serve"], False), (["moeflow", "-v", "serve"], True)):
        monkeypatch.delenv("MOEFLOW_VERBOSE", raising=False)
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as stop:
            cli.main()
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "error: Ray Serve did not start the app" in err
        assert ("HAProxy crashed during startup" in err) == shows_cause


def test_serves_own_info_lines_stay_off_the_terminal_by_default(monkeypatch, capsys):
    """Ray Serve re-configures its driver logger whenever it starts ("Started Serve ...",
    "Application ... is ready" at INFO); quiet mode keeps those off, warnings still show."""
    import logging

    from ray.serve._private.logging_utils import configure_default_serve_logger

    from workflows.verbosity import VERBOSE_ENV, configure

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    configure()
    configure_default_serve_logger()  # what serve.start does: level INFO, own stderr handler
    log = logging.getLogger("ray.serve")
    log.info("Application 'moeflow' is ready")
    log.warning("a replica is unhealthy")
    err = capsys.readouterr().err
    assert "is ready" not in err and "a replica is unhealthy" in err
