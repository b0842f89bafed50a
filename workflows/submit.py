"""`moeflow submit`: the same pipeline as a Ray Job on a cluster.

The validated config travels in the job's runtime_env (env var
MOEFLOW_CONFIG_YAML), so the job runs exactly what was checked here; the
entrypoint is `python -m workflows.cli run env:MOEFLOW_CONFIG_YAML`. Ray token
authentication is picked up from this environment (RAY_AUTH_MODE=token with
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) by Ray's own client.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import yaml

from moeflow.core.errors import UserError
from workflows.verbosity import VERBOSE_ENV, verbose

CONFIG_ENV = "MOEFLOW_CONFIG_YAML"
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
                 "MLFLOW_TRACKING_PASSWORD")


def load_runtime_env(path: Path) -> dict:
    """Read runtime_env YAML; a relative working_dir is relative to the YAML's repo."""
    if not Path(path).is_file():
        raise UserError(f"runtime_env file not found: {path}")
    env = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(env, dict):
        raise UserError(f"{path}: runtime_env must be a mapping")
    wd = env.get("working_dir")
    if wd and "://" not in wd and not Path(wd).is_absolute():
        env["working_dir"] = str((Path(path).resolve().parent.parent / wd).resolve())
    return env


def job_env(runtime_env_path: Path, extra: dict[str, str] | None = None) -> dict:
    """The runtime_env of a moeflow job: the YAML's, plus `extra` env vars, the MLflow
    settings of this shell (the job tracks into the same store) and `-v`."""
    runtime_env = load_runtime_env(runtime_env_path)
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.update(extra or {})
    for name in FORWARDED_ENV:  # the job tracks into the same store as this shell
        if os.environ.get(name):
            env_vars.setdefault(name, os.environ[name])

    if verbose():  # `moeflow -v submit`: the job's driver log shows everything too
        env_vars.setdefault(VERBOSE_ENV, "1")
    runtime_env["env_vars"] = env_vars
    return runtime_env


def build_job(raw_config: dict, runtime_env_path: Path) -> tuple[str, dict]:
    """Entrypoint and runtime_env for the pipeline job."""
    runtime_env = job_env(runtime_env_path, {CONFIG_ENV: yaml.safe_dump(raw_config, sort_keys=False)})
    return f"python -m workflows.cli run env:{CONFIG_ENV}", runtime_env


def _client(address: str):
    """Ray's job client for `address` (one line on failure: refused, auth)."""
    # lazy: ray: heavy, loaded only when this runs
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # connection refused, auth failure: one line
        raise UserError(f"Ray at {address}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def submit_job(address: str, entrypoint: str, runtime_env: dict, submission_id: str,
               metadata: dict[str, str]):
    """Submit one job; returns (client, job id)."""
    client = _client(address)
    try:
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                   submission_id=submission_id, metadata=metadata)
    except Exception as exc:  # auth failure, bad runtime_env: one line
        raise UserError(f"submitting to Ray at {address} failed: {_first_line(exc)}") from None
    return client, job_id


def running_jobs(address: str, key: str, value: str) -> list[str]:
    """Submission ids of the jobs not yet ended whose metadata has `key` = `value`."""
    # lazy: ray: heavy, loaded only when this runs
    from ray.job_submission import JobStatus

    client = _client(address)
    ended = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    try:
        jobs = client.list_jobs()
    except Exception as exc:  # the connection or the token refused: one line
        raise UserError(f"listing jobs at {address} failed: {_first_line(exc)}") from None
    return [j.submission_id for j in jobs
            if (j.metadata or {}).get(key) == value and j.status not in ended and j.submission_id]


def submit_pipeline(raw_config: dict, *, address: str, runtime_env_path: Path,
                    follow: bool = False, wait: bool = True, console=None,
                    timeout_s: float = 24 * 3600) -> str:
    """Submit; optionally stream logs and wait. Returns the final job status."""
    # lazy: ray: heavy, loaded only when this runs
    from ray.job_submission import JobStatus

    entrypoint, runtime_env = build_job(raw_config, runtime_env_path)
    name = raw_config.get("name", "moeflow")
    client, job_id = submit_job(address, entrypoint, runtime_env, f"moeflow-{name}-{int(time.time())}",
                                {"moeflow.config_name": str(name)})
    if console:
        console.print(f"submitted job {job_id} to {address}")
    if not wait:
        return "PENDING"
    if follow:
        async def tail() -> None:
            async for lines in client.tail_job_logs(job_id):
                print(lines, end="", flush=True)

        asyncio.run(tail())
    deadline = time.time() + timeout_s
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while (status := client.get_job_status(job_id)) not in terminal:
        if time.time() > deadline:
            raise UserError(f"job {job_id} still {status} after {timeout_s:.0f}s")
        time.sleep(1.0)
    if console:
        console.print(f"job {job_id}: {status.value}")
    return status.value
