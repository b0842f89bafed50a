"""What a pipeline run records about its stages: each stage's state as the driver tracks
it (`StageState`, handed to `on_event`), the run's `Outcome`, and the summary its parent
MLflow run gets when it ends (`publish_stages`: every stage's `headline` metrics as
`<stage>.<metric>`, the reused stage runs, the `stages.json` table)."""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Mapping

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from moeflow.core import tracking as T

TERMINAL = {"done", "reused", "failed", "skipped"}


@dataclass
class StageState:
    name: str
    state: str = "pending"  # pending|running|done|reused|failed|skipped
    run_id: str | None = None
    attempts: int = 0
    seconds: float | None = None
    error: str | None = None
    key: str = ""
    result: dict | None = None
    started: float = 0.0
    out_dir: str = ""
    note: str = ""  # the latest ctx.note() line (event "note")
    notes_offset: int = 0
    progress: dict | None = None  # {"done", "total", "what"} (event "progress")
    bind_retries: int = 0  # attempts repeated after a transient "address already in use"


@dataclass
class Outcome:
    run_id: str
    status: str  # FINISHED | FAILED | KILLED
    stages: dict[str, StageState] = field(default_factory=dict)
    tracking_uri: str = ""
    exit_code: int | None = None  # 143 after SIGTERM (128 + 15, as a shell reports it)

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"


HEADLINE_LIMIT = 40  # metrics per stage on the parent run


def headline(result: dict) -> dict[str, float]:
    """A stage's headline metrics: its record's `headline` dict when it has one, else
    its numeric (and boolean) values at the top level and one level down
    (`metrics.eval_loss`, `plan.num_workers`), at most HEADLINE_LIMIT.

    Stage authors: return `"headline": {"tokens_per_s": 812.0, ...}` in the result
    record to choose what the pipeline's parent run shows as `<stage>.<metric>`.
    """
    def number(v):
        if isinstance(v, bool):
            return float(v)
        if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
            return float(v)
        return None

    chosen = result.get("headline")
    items = chosen.items() if isinstance(chosen, dict) else [
        (f"{k}.{k2}" if isinstance(v, dict) else k, v2)
        for k, v in result.items() for k2, v2 in (v.items() if isinstance(v, dict) else [(k, v)])]
    out: dict[str, float] = {}
    # by name: a reused stage's record comes back from result.json with its keys sorted, so
    # the first HEADLINE_LIMIT in the stage's own order were another set than a fresh run's
    # (`runs --compare` showed metrics one of the two had as missing)
    for key, value in sorted(items, key=lambda kv: str(kv[0])):
        num = number(value)
        if num is not None and len(out) < HEADLINE_LIMIT:
            out[re.sub(r"[^\w\-./ ]", "_", str(key))] = num  # MLflow's metric-name alphabet
    return out


def publish_stages(client: MlflowClient, parent_id: str, exp_id: str,
                   states: Mapping[str, StageState], estimated: Mapping[str, float],
                   started: float) -> None:
    """Headline metrics of every finished or reused stage onto the parent run, as
    `<stage>.<metric>`, so pipelines compare side by side in the MLflow UI; reused
    stage runs linked from the parent (tags `moeflow.reused.<stage>` and the
    table artifact `stages.json`); `pipeline.seconds` when every stage ran since `started`."""
    now, metrics, rows = int(time.time() * 1000), [], []
    for st in states.values():
        if st.state in ("done", "reused") and st.result is not None:
            for key, value in headline(st.result).items():
                metrics.append(Metric(f"{st.name}.{key}", value, now, 0))
            if st.seconds is not None and st.state == "done":
                metrics.append(Metric(f"{st.name}.seconds", float(st.seconds), now, 0))
        if st.state == "reused" and st.run_id:
            client.set_tag(parent_id, T.REUSED_PREFIX + st.name, st.run_id)
        rows.append(_row(client, parent_id, exp_id, estimated, st))
    if started and states and all(s.state == "done" for s in states.values()):
        # every stage ran in this attempt: its wall time is what pipeline.est_seconds priced
        metrics.append(Metric("pipeline.seconds", time.time() - started, now, 0))
    for i in range(0, len(metrics), 1000):
        client.log_batch(parent_id, metrics=metrics[i:i + 1000])
    if rows:
        with warnings.catch_warnings():  # pandas' dtype deprecation inside log_table
            warnings.simplefilter("ignore")
            client.log_table(parent_id, data={k: [r[k] for r in rows] for k in rows[0]},
                             artifact_file="stages.json")


def _row(client: MlflowClient, parent_id: str, exp_id: str, estimated: Mapping[str, float],
         st: StageState) -> dict:
    pipeline = ""
    if st.state == "reused" and st.run_id:
        pipeline = client.get_run(st.run_id).data.tags.get(T.PIPELINE, "")
    return {"stage": st.name, "state": st.state, "run_id": st.run_id or "",
            "pipeline_run": pipeline or (parent_id if st.run_id else ""),
            "seconds": round(st.seconds, 3) if st.seconds is not None else None,
            "est_seconds": round(estimated[st.name], 3) if st.name in estimated else None,
            "link": f"#/experiments/{exp_id}/runs/{st.run_id}" if st.run_id else ""}
