"""Terminal reports: stage tables, status JSON, recent runs."""

from __future__ import annotations

import time
from typing import Mapping

from rich.table import Table

from workflows import tracking as T

STYLE = {"done": "green", "reused": "cyan", "failed": "red", "skipped": "yellow",
         "pending": "dim", "running": "blue"}


def _fmt_seconds(value) -> str:
    return "" if value is None else f"{value:.1f}"


def stage_table(states: Mapping, title: str = "") -> Table:
    table = Table(title=title or None)
    for col in ("stage", "state", "attempts", "seconds", "run id", "error"):
        table.add_column(col, overflow="fold", no_wrap=col == "run id")
    for st in states.values():
        table.add_row(st.name, f"[{STYLE.get(st.state, '')}]{st.state}[/]", str(st.attempts),
                      _fmt_seconds(st.seconds), st.run_id or "", st.error or "")
    return table


def event_printer(console):
    """Progress: one line per stage transition (log-friendly, also in Ray job logs)."""
    marks = {"started": "▶", "done": "✓", "failed": "✗", "skipped": "–", "reused": "↺"}

    def on_event(kind: str, st) -> None:
        if kind not in marks:
            return
        extra = ""
        if kind == "done" and st.seconds is not None:
            extra = f" in {st.seconds:.1f}s"
        elif kind == "failed":
            extra = f": {st.error}"
        elif kind == "reused":
            extra = f" (run {st.run_id})"
        stamp = time.strftime("%H:%M:%S")
        console.print(f"{stamp} {marks[kind]} {st.name} {kind}{extra}",
                      style=STYLE.get(kind if kind != "started" else "running"))

    return on_event


def pipeline_status(client, run_id: str) -> dict:
    """The `moeflow status --json` document, read from MLflow only."""
    parent = T.get_pipeline_run(client, run_id)
    tags = parent.data.tags
    children = T.child_runs(client, parent)
    order = [s for s in tags.get("moeflow.stages", "").split(",") if s]
    for name in sorted(k[len(T.STATE_PREFIX):] for k in tags if k.startswith(T.STATE_PREFIX)):
        if name not in order:
            order.append(name)
    stages = []
    for name in order:
        own = [r for r in children if r.data.tags.get(T.STAGE) == name]
        rid = tags.get(T.STAGE_RUN_PREFIX + name)
        seconds = None
        if rid:
            run = next((r for r in own if r.info.run_id == rid), None) or client.get_run(rid)
            if run.info.end_time and run.info.start_time:
                seconds = round((run.info.end_time - run.info.start_time) / 1000.0, 3)
        stages.append({"name": name, "state": tags.get(T.STATE_PREFIX + name, "pending"),
                       "run_id": rid, "attempts": len(own), "seconds": seconds})
    return {"run_id": run_id, "status": parent.info.status, "stages": stages}


def status_table(info: dict) -> Table:
    table = Table(title=f"pipeline run {info['run_id']}: {info['status']}")
    for col in ("stage", "state", "attempts", "seconds", "run id"):
        table.add_column(col)
    for s in info["stages"]:
        table.add_row(s["name"], f"[{STYLE.get(s['state'], '')}]{s['state']}[/]",
                      str(s["attempts"]), _fmt_seconds(s["seconds"]), s["run_id"] or "")
    return table


def runs_table(runs) -> Table:
    table = Table(title="pipeline runs")
    for col in ("run id", "name", "status", "started", "stages"):
        table.add_column(col)
    for run in runs:
        tags = run.data.tags
        states = [f"{k[len(T.STATE_PREFIX):]}={v}" for k, v in sorted(tags.items())
                  if k.startswith(T.STATE_PREFIX)]
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.info.start_time / 1000))
        table.add_row(run.info.run_id, run.info.run_name or "", run.info.status, started,
                      " ".join(states))
    return table


def results_table(states: Mapping) -> Table:
    """Headline outputs of each stage (paths, checksums, scalar metrics)."""
    table = Table(title="stage outputs")
    table.add_column("stage")
    table.add_column("output", overflow="fold")
    for st in states.values():
        metrics, scalars = [], []
        for key, value in (st.result or {}).items():
            if isinstance(value, dict) and key == "metrics":
                metrics += [f"{k}={_short(v)}" for k, v in value.items()
                            if isinstance(v, (int, float, str, bool))]
            elif isinstance(value, (int, float, str, bool)):
                scalars.append(f"{key}={_short(value)}")
        table.add_row(st.name, "\n".join(scalars[:8] + metrics[:10]))
    return table


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 100 else text[:97] + "..."
