"""Commands that join a running Ray (`rebalance`, `run`/`deploy --address`) do so with the auth
the local Ray uses (token auth, on by default for a Ray `ray.init()` starts) without
RAY_AUTH_MODE in their environment, and a cluster they cannot reach is one line, in seconds."""

import subprocess
import sys
import time

from mlflow.tracking import MlflowClient

from moeflow.core import tracking as T
from tests.conftest import cli_env, free_port

JOIN = ("import ray, sys; from workflows.raylocal import join_ray; join_ray(sys.argv[1]); "
        "print('joined', int(ray.cluster_resources()['CPU']))")


def _env(tmp_path) -> dict:
    env = cli_env(tmp_path)
    env.pop("RAY_AUTH_MODE", None)  # a user's shell: ray.init() set it in this process only
    return env


def test_a_local_ray_with_token_auth_is_joined_by_its_address(ray_local, tmp_path):
    import ray

    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-c", JOIN, address], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0 and "joined 2" in proc.stdout, proc.stdout + proc.stderr


def test_rebalance_that_cannot_reach_its_cluster_is_one_line(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("t")
    run = client.create_run(exp, tags={T.KIND: "pipeline"}).info.run_id
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "rebalance", "--run", run, "--address", address,
                           "--tracking-uri", uri], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert f"cannot reach the Ray cluster at {address}" in lines[0]
    assert time.monotonic() - start < 60  # Ray itself retries for minutes


def test_reading_commands_write_no_store_where_none_was_asked_for(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "rebalance", "--run", "abc", "--address",
                           "127.0.0.1:1"], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 2 and "no MLflow store at" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []
