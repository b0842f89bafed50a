"""`moeflow submit` against a local Ray head this test starts (own temp dir,
own ports, token auth on) and stops by its process group."""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import BIN, REPO, abcd_config, cli_env, free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_head():
    temp = tempfile.mkdtemp(prefix="/tmp/mfh")
    token = secrets.token_hex(16)
    ports = {k: free_port() for k in ("port", "dashboard-port", "ray-client-server-port",
                                       "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                       "runtime-env-agent-port", "metrics-export-port",
                                       "node-manager-port", "object-manager-port")}
    # TMPDIR: the head's own temporary files (multiprocessing's pymp-* of a process killed below)
    # go in its temp dir, removed with it
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PYTHONPATH=str(REPO),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}", TMPDIR=temp)
    env.pop("RAY_ADDRESS", None)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2",
           f"--temp-dir={temp}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
           "--min-worker-port=20000", "--max-worker-port=29999"]
    cmd += [f"--{k}={v}" for k, v in ports.items()]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:  # 401 without the token: it is up
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("local Ray head did not come up")
        yield address, token, ports
    finally:
        _stop(proc, temp)


def _stop(proc, temp):
    """Stop what this fixture started: its process group and any daemon using its temp dir,
    then remove the temp dir."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp in part for part in (p.info["cmdline"] or [])):
                p.kill()
                left.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(left, timeout=10)
    deadline = time.time() + 10
    while os.path.exists(temp) and time.time() < deadline:
        shutil.rmtree(temp, ignore_errors=True)
        time.sleep(0.2)


@pytest.mark.slow  # a pipeline as a Ray Job (its own driver process): the joined run below stays default
@pytest.mark.ci
def test_submit_runs_pipeline_to_succeeded(ray_head, tmp_path):
    address, token, _ = ray_head
    raw = abcd_config(tmp_path)
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = cli_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "submit", str(cfg),
                           "--address", address, "--follow"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SUCCEEDED" in proc.stdout
    assert "✓ c done" in proc.stdout, "--follow streams the job's logs"
    client = MlflowClient(raw["tracking"]["uri"])
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id],
                              filter_string="tags.`moeflow.kind` = 'pipeline'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"


def test_submit_without_token_is_refused_cleanly(ray_head, tmp_path):
    address, _, _ = ray_head
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(abcd_config(tmp_path)))
    env = cli_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="wrong-token-0000")
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "submit", str(cfg),
                           "--address", address], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr


def test_run_joins_an_existing_cluster_with_address(ray_head, tmp_path):
    _, token, ports = ray_head
    cfg = tmp_path / "p.yaml"
    raw = abcd_config(tmp_path)
    cfg.write_text(yaml.safe_dump(raw))
    env = cli_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
                  RAY_ADDRESS=f"127.0.0.1:{ports['port']}")
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "run", str(cfg)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FINISHED" in proc.stdout
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


@pytest.mark.slow  # three Ray Job submissions and a stop, each a driver process of its own
@pytest.mark.ci
def test_watch_runs_as_a_ray_job_one_per_experiment(ray_head, tmp_path):
    """`moeflow watch --address`: the watcher is a Ray Job that outlives the shell; a second
    one for the same verdict experiment is refused naming the first; once that is stopped, a
    new submission starts (its state is MLflow's, so it resumes where the other stopped)."""
    import re

    address, token, _ = ray_head
    env = cli_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "workflows.cli", "watch", "--address", address, "--tracking-uri", uri,
           "--experiment", "watch-job", "--interval", "1"]

    def submit(*extra):
        return subprocess.run(cmd + list(extra), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=180)

    def ray_job(*args) -> str:  # Ray's own CLI, with the cluster's token
        out = subprocess.run([str(BIN / "ray"), "job", *args, "--address", address], env=env,
                             capture_output=True, text=True, timeout=120)
        return out.stdout + out.stderr

    def wait_for(job, states, timeout=240):
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = ray_job("status", job)  # "Status for job 'J': RUNNING", "Job 'J' was stopped"
            found = re.search(r"Status for job '[^']+': (\w+)", text)
            status = found.group(1) if found else next(
                (s for s, word in (("STOPPED", "was stopped"), ("SUCCEEDED", "succeeded"), ("FAILED", "failed"))
                 if f"' {word}" in text), None)
            if status in states:
                return status
            time.sleep(2)
        return None

    first = submit()
    assert first.returncode == 0, first.stdout + first.stderr
    job = re.search(r"submitted watcher job (\S+)", first.stdout).group(1)
    assert wait_for(job, {"RUNNING", "FAILED", "SUCCEEDED"}) == "RUNNING", ray_job("logs", job)[-2000:]
    second = submit()
    assert second.returncode == 2 and job in second.stderr and "already runs" in second.stderr, second.stderr
    assert "Traceback" not in second.stderr
    stopped = ray_job("stop", job)
    assert wait_for(job, {"STOPPED", "FAILED", "SUCCEEDED"}, 120) == "STOPPED", stopped + ray_job("status", job)
    again = submit("--once")  # restarted: nothing pending in an empty registry, so it ends
    assert again.returncode == 0, again.stdout + again.stderr
    job2 = re.search(r"submitted watcher job (\S+)", again.stdout).group(1)
    assert job2 != job
    assert wait_for(job2, {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED", ray_job("logs", job2)[-2000:]
