"""One stage execution, inside its Ray task: the stage's own out dir (local, or this node's
scratch published to the store), its MLflow child run, its result record; and how its
failure is told in one line.
"""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path

import mlflow
import ray

from moeflow.core import storage
from moeflow.core import tracking as T
from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.model.remote_code import stage_record
from tasks.base import NOTES, PROGRESS, StageContext, StageSpec


def execute_stage(spec: StageSpec, cfg_json: dict, inputs: dict, out_dir: str,
                  run_id: str, tracking_uri: str, pipeline_run_id: str) -> dict:
    """Body of the Ray task for one stage execution (runs on a worker)."""
    io = None
    if storage.is_uri(out_dir):  # workdir in a store: work in this node's scratch, publish after
        from moeflow.core.storage.stage import StageIO

        io = StageIO(out_dir, cfg_json["workdir"], live_files=(NOTES, PROGRESS))
        out = io.open(keep=spec.resumable)
        cfg_json, inputs = io.localize(cfg_json, inputs, model_by_ranges=spec.model_by_ranges)
    cfg = PipelineConfig.model_validate(cfg_json)
    if io is None:
        out = Path(out_dir)
        if out.exists() and not spec.resumable:  # a retried task after worker loss starts clean
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").unlink(missing_ok=True)  # a resumable stage's old record never counts
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        ctx = StageContext(stage=spec.name, config=cfg, inputs=inputs, out_dir=out,
                           mlflow_run_id=run_id, tracking_uri=tracking_uri,
                           pipeline_run_id=pipeline_run_id, store_dir=out_dir if io else None,
                           stored=dict(io.back) if io else {})
        try:
            code = _remote_code(cfg, inputs)
            result = spec.run(ctx)
        except BaseException as exc:  # the run's error: one line; the whole story in error.txt
            mlflow.set_tag(T.ERROR, one_line(exc))
            mlflow.log_text(traceback.format_exc(), "error.txt")
            raise
        finally:
            if io is not None:
                io.stop_mirror()
        result = dict(result or {})
        if code:
            result["remote_code"] = code
        json.dumps(result)  # the record must be small JSON; fail here if not
        if io is not None:
            result = io.to_record(result)
        (out / "result.json").write_text(json.dumps(result, indent=2, sort_keys=True))
        if io is not None:
            io.publish()  # the manifest last: only now does the output exist
        mlflow.log_dict(result, "result.json")
    return result


def one_line(exc: BaseException, limit: int = 500) -> str:
    """The line of an exception that says what went wrong: a UserError's message, HAProxy's
    ALERT inside a Ray/Serve failure, else the exception's type and first line."""
    text = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    alerts = [line for line in lines if "[ALERT]" in line and "Fatal errors" not in line]
    return (alerts or lines or [type(exc).__name__])[0][:limit]


def _remote_code(cfg: PipelineConfig, inputs: dict) -> dict[str, str]:
    """The checkpoint's own code for this stage (checked against convert's sha256
    record, loaded, logged as `remote_code.<file>` params); {} when it has none."""

    code = stage_record(cfg, inputs)
    if code:
        mlflow.log_params({f"remote_code.{name}": sha for name, sha in code.items()})
    return code


def error_message(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return one_line(cause)
    if isinstance(exc, ray.exceptions.TaskCancelledError):
        return "cancelled"
    return one_line(exc)


def release_orphaned_placement_groups() -> list[str]:
    """Remove placement groups whose creator actor died (ids of those removed).

    A Ray placement group created by an actor lives until its job ends unless that actor
    removes it (Ray's lifetime rule: creator actor AND job dead). Ray Train's controller
    removes its workers' group when training ends; a controller lost with its node never
    does, and Ray reschedules the orphan's bundles onto the surviving nodes, where they hold
    CPUs for the rest of the pipeline: a later stage placed there, or finetune's own
    retry, waits forever. The runner calls this every few seconds while stages run. Read
    through Ray's GCS table (the public `placement_group_table` omits the creator); Ray is
    pinned in pyproject.toml.
    """
    from ray._private.state import state  # lazy: Ray's GCS accessor, only when Ray is up
    from ray.core.generated import gcs_pb2  # lazy: as above
    from ray.util.placement_group import PlacementGroup, remove_placement_group  # lazy: as above

    removed: list[str] = []
    try:
        table = state._connect_and_get_accessor().get_placement_group_table()
    except Exception:  # noqa: BLE001 - best effort: no table, nothing to release
        return removed
    table_data = gcs_pb2.PlacementGroupTableData  # type: ignore[attr-defined]  # generated code
    for raw in table:
        pg = table_data.FromString(raw)
        # a group a task or the driver made reads as "actor dead" from the start: only a
        # real creator actor that died counts
        by_actor = bool(pg.creator_actor_id) and not ray.ActorID(pg.creator_actor_id).is_nil()
        if (by_actor and pg.creator_actor_dead and not pg.is_detached
                and pg.state != table_data.REMOVED):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
            removed.append(pg.placement_group_id.hex())
    return removed


# a port taken between choosing it and binding it (by another program on a busy host): worth
# one more attempt of the stage, which picks its ports anew
# a port chosen free and taken before it was bound (HAProxy's, Serve's proxy's own text)
TRANSIENT_BIND = ("Address already in use", "cannot bind socket", "EADDRINUSE",
                  "Failed to bind to address")
BIND_RETRIES = 1


