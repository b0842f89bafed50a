"""MLflow plumbing shared by the runner and the CLI.

The run layout is a contract other tools rely on:
- a parent run per pipeline, tagged `moeflow.kind=pipeline`, named after the
  config; its tags `moeflow.state.<stage>` / `moeflow.stage_run.<stage>` hold
  the latest state of each stage;
- one child run per stage execution (`mlflow.parentRunId`), tagged
  `moeflow.stage`, `moeflow.attempt`, `moeflow.cache_key`; params are the
  flattened stage config; outputs are artifacts, `result.json` the record;
- the parent run also carries each stage's headline metrics as
  `<stage>.<metric>` (workflows.outcome.headline), tags `moeflow.reused.<stage>` naming
  the stage runs it reused from earlier pipelines, and `stages.json`, a table
  of every stage's run;
- the experiment is tagged as a model-training experiment
  (`mlflow.experimentKind`), so the UI opens on runs, not on GenAI traces.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from moeflow.core import storage
from moeflow.core.errors import UserError

KIND = "moeflow.kind"
STAGE = "moeflow.stage"
ATTEMPT = "moeflow.attempt"
CACHE_KEY = "moeflow.cache_key"
PIPELINE = "moeflow.pipeline_run"
OUT_DIR = "moeflow.out_dir"
ERROR = "moeflow.error"
ESTIMATE_ERROR = "moeflow.estimate_error"  # why a pipeline run has no dry-run estimate
PARENT = "mlflow.parentRunId"
STATE_PREFIX = "moeflow.state."
STAGE_RUN_PREFIX = "moeflow.stage_run."
REUSED_PREFIX = "moeflow.reused."
DRIVER = "moeflow.driver"  # HOST:PID of the process running the pipeline (`status` checks it is alive)
# MLflow 3 picks the UI's experiment view from this tag (else it infers one, and
# an experiment without traces can open in the GenAI view)
EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
DEFAULT_STORE = "mlruns"


def resolve_tracking_uri(configured: str | None = None, create: bool = True) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else sqlite:///<abs>/mlruns/mlflow.db.

    A plain local path names a store, not MLflow's file store (MLflow 3.17 refuses
    that backend): `DIR` becomes sqlite:///DIR/mlflow.db, `FILE.db` sqlite:///FILE.db.
    `create=False`: the local store's directory is not made (a command that serves or
    reads must not leave a store where none was asked for)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri and ("://" in uri or uri.startswith("databricks")):
        return uri
    path = Path(uri).resolve() if uri and uri.endswith(".db") else Path(uri or DEFAULT_STORE).resolve() / "mlflow.db"
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def existing_tracking_uri(configured: str | None = None) -> str:
    """`resolve_tracking_uri` for a command that reads runs: a local store that is not there
    is one line naming it, not a new empty store (sqlite creates its file on first use)."""
    uri = resolve_tracking_uri(configured, create=False)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise UserError(f"no MLflow store at {uri[len('sqlite:///'):]}: run from the project's directory, "
                        "or name the store with --tracking-uri / $MLFLOW_TRACKING_URI")
    return uri


def artifact_root_for(uri: str, configured: str | None = None) -> str | None:
    """Where a new experiment keeps artifacts: beside a local sqlite db; the
    server decides for a remote tracking server."""
    if configured:
        return configured if "://" in configured else Path(configured).resolve().as_uri()
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "artifacts").as_uri()
    return None


def client_for(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri)


def experiment_id(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        if EXPERIMENT_KIND not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return exp.experiment_id
    return client.create_experiment(name, artifact_location=artifact_root,
                                    tags={EXPERIMENT_KIND: MODEL_TRAINING})


def get_pipeline_run(client: MlflowClient, run_id: str):
    """The parent run `run_id`, or a UserError if it is not a moeflow pipeline."""
    if not run_id.strip():
        raise UserError("no run id given")
    try:
        run = client.get_run(run_id)
    except Exception:  # MlflowException for unknown ids; message is noisy
        raise UserError(f"no MLflow run {run_id!r} in {client.tracking_uri}") from None
    if run.data.tags.get(KIND) != "pipeline":
        raise UserError(f"run {run_id} is not a moeflow pipeline run (tag {KIND} missing)")
    return run


def child_runs(client: MlflowClient, parent) -> list:
    """Stage runs of a pipeline run, oldest first."""
    runs = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT}` = '{parent.info.run_id}'",
        run_view_type=ViewType.ACTIVE_ONLY, max_results=5000, order_by=["attributes.start_time ASC"])
    return list(runs)


def open_descendants(client: MlflowClient, exp_id: str, run_id: str) -> list[str]:
    """Ids of the RUNNING runs nested (at any depth) under `run_id`."""
    found, parents = [], [run_id]
    while parents:
        parent = parents.pop()
        for run in client.search_runs([exp_id], filter_string=f"tags.`{PARENT}` = '{parent}'",
                                      max_results=5000):
            parents.append(run.info.run_id)
            if run.info.status in ("RUNNING", "SCHEDULED"):
                found.append(run.info.run_id)
    return found


def driver_tag() -> str:
    """This process as the DRIVER tag names it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def lost_driver(tags: dict) -> str | None:
    """The DRIVER of a RUNNING pipeline run when it is a process on this host that no longer
    exists (killed: it could not close the run), else None."""
    host, _, pid = tags.get(DRIVER, "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return tags[DRIVER]
    except PermissionError:  # alive, another user's
        return None
    return None


def find_cached(client: MlflowClient, exp_id: str, key: str):
    """Newest FINISHED stage run with this cache key whose output dir still exists."""
    runs = client.search_runs(
        [exp_id], filter_string=f"tags.`{CACHE_KEY}` = '{key}' and attributes.status = 'FINISHED'",
        max_results=20, order_by=["attributes.start_time DESC"])
    for run in runs:
        if has_record(run.data.tags.get(OUT_DIR) or ""):
            return run
    return None


def has_record(out: str) -> bool:
    """A stage's output is still there: its result.json, or in a store its manifest."""

    if storage.is_uri(out):
        return storage.published(out)
    return bool(out) and (Path(out) / "result.json").is_file()


def read_result(run) -> dict:
    """The stage result record of a finished stage run (kept in its out dir)."""

    out = run.data.tags.get(OUT_DIR) or ""
    if storage.is_uri(out):  # in a store: the record of a published output
        if not storage.published(out):
            raise UserError(f"stage run {run.info.run_id}: output {out} is not in the store "
                            f"(no {storage.MANIFEST})")
        return json.loads(storage.read_text(storage.join(out, "result.json")))
    path = Path(out) / "result.json"
    if not path.is_file():
        raise UserError(f"stage run {run.info.run_id}: result record {path} is missing")
    return json.loads(path.read_text())


def download_text(client: MlflowClient, run_id: str, name: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(run_id, name, tmp)
        except Exception:
            raise UserError(f"run {run_id} has no artifact {name!r}") from None
        return Path(local).read_text()


def pipeline_runs(client: MlflowClient, experiment: str | None, limit: int = 20) -> list:
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        ids = [exp.experiment_id] if exp else []
    else:
        ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return []
    return list(client.search_runs(ids, filter_string=f"tags.`{KIND}` = 'pipeline'",
                                   max_results=limit, order_by=["attributes.start_time DESC"]))
