"""Terminal reports: stage tables, status JSON, recent runs, run comparison.

Tables are laid out for an 80-column terminal: identifiers and states never
wrap (a run id is one unbroken word), free text wraps at spaces, and the
borders are light (box.SIMPLE_HEAD) so the content gets the width.
"""

from __future__ import annotations

import time
from typing import Mapping

from rich import box
from rich.console import Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from moeflow.core import tracking as T

STYLE = {"done": "green", "reused": "cyan", "failed": "red", "skipped": "yellow",
         "pending": "dim", "running": "blue"}


def _fmt_seconds(value) -> str:
    return "" if value is None else f"{value:.1f}"


def _table(title: str | None, columns: list[tuple[str, dict]]) -> Table:
    """A table whose identifier columns never wrap and whose text columns wrap at spaces."""
    table = Table(title=title or None, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    for name, opts in columns:
        table.add_column(name, **opts)
    return table


KEEP = {"no_wrap": True, "overflow": "ignore"}  # ids, states, numbers: never broken
TEXT = {"overflow": "fold", "ratio": 1}  # wraps at spaces; only a word longer than the column folds


def stage_table(states: Mapping, title: str = "") -> Group:
    """One row per stage (state, attempts, seconds, stage run id), then one line per
    stage error below the table, where it can wrap at spaces over the full width."""
    table = _table(title, [("stage", KEEP), ("state", KEEP), ("tries", {**KEEP, "justify": "right"}),
                           ("s", {**KEEP, "justify": "right"}), ("stage run", KEEP)])
    errors = []
    for st in states.values():
        table.add_row(st.name, Text(st.state, style=STYLE.get(st.state, "")), str(st.attempts),
                      _fmt_seconds(st.seconds), st.run_id or "")
        if st.error:
            errors.append(Text.assemble((f"{st.name}: ", STYLE.get(st.state, "")), st.error))
    return Group(table, *errors)


class _Bars:
    """Progress of long work: a live bar per stage on a terminal (rich, transient), a
    line per quarter when the output is a log (Ray job logs, CI)."""

    def __init__(self, console):
        self.console, self.live, self.tasks, self.quarter = console, None, {}, {}

    def update(self, st) -> None:
        p = st.progress or {}
        done, total = float(p.get("done", 0)), float(p.get("total", 0) or 0)
        label = f"{st.name}: {p.get('what') or 'progress'}"
        if total <= 0:
            return
        if not self.console.is_terminal:
            q = int(4 * done / total)
            if q > self.quarter.get(label, 0):
                self.quarter[label] = q
                self.console.print(f"{time.strftime('%H:%M:%S')}   {label} {done:.0f}/{total:.0f}")
            return

        if self.live is None:
            self.live = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeRemainingColumn(),
                                 console=self.console, transient=True)
            self.live.start()
        if label not in self.tasks:
            self.tasks[label] = self.live.add_task(label, total=total)
        self.live.update(self.tasks[label], completed=done, total=total)

    def end(self, name: str) -> None:
        for label in [k for k in self.tasks if k.startswith(f"{name}: ")]:
            self.live.remove_task(self.tasks.pop(label))
        if self.live is not None and not self.tasks:
            self.live.stop()
            self.live = None


def event_printer(console):
    """One line per stage transition (log-friendly, also in Ray job logs), stage notes,
    and progress bars for long work."""
    marks = {"started": "▶", "done": "✓", "failed": "✗", "skipped": "–", "reused": "↺"}
    bars = _Bars(console)

    def on_event(kind: str, st) -> None:
        if kind == "progress":
            bars.update(st)
            return
        if kind in ("note", "warning"):  # a stage's ctx.note(), or the runner's own warning
            console.print(f"{time.strftime('%H:%M:%S')}   {st.name}: {st.note}",
                          style="yellow" if kind == "warning" else None, soft_wrap=True)
            return
        if kind not in marks:
            return
        if kind in ("done", "failed", "skipped"):
            bars.end(st.name)
        extra = ""
        if kind == "done" and st.seconds is not None:
            extra = f" in {st.seconds:.1f}s"
        elif kind == "failed":
            extra = f": {st.error}"
        elif kind == "reused":
            extra = f" (run {st.run_id})"
        stamp = time.strftime("%H:%M:%S")
        console.print(f"{stamp} {marks[kind]} {st.name} {kind}{extra}",  # soft_wrap: a path stays whole
                      style=STYLE.get(kind if kind != "started" else "running"), soft_wrap=True)

    return on_event


def pipeline_status(client, run_id: str) -> dict:
    """The `moeflow status --json` document, read from MLflow only."""
    parent = T.get_pipeline_run(client, run_id)
    tags = parent.data.tags
    children = T.child_runs(client, parent)
    order = stage_order(tags)
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
    info = {"run_id": run_id, "status": parent.info.status, "stages": stages}
    lost = T.lost_driver(tags) if parent.info.status == "RUNNING" else None
    if lost:
        info["hint"] = (f"its driver ({lost}) is gone, so nothing runs and nothing closed the run: "
                        f"`moeflow resume {run_id}` continues it")
    return info


def status_table(info: dict) -> Table:
    table = _table(f"pipeline run {info['run_id']}: {info['status']}",
                   [("stage", KEEP), ("state", KEEP), ("tries", {**KEEP, "justify": "right"}),
                    ("s", {**KEEP, "justify": "right"}), ("stage run", KEEP)])
    for s in info["stages"]:
        table.add_row(s["name"], Text(s["state"], style=STYLE.get(s["state"], "")),
                      str(s["attempts"]), _fmt_seconds(s["seconds"]), s["run_id"] or "")
    return table


def stage_order(tags: Mapping[str, str]) -> list[str]:
    """Stage names of a pipeline run in DAG order (the run's `moeflow.stages` tag),
    then any other stage it has a state for."""
    order = [s for s in tags.get("moeflow.stages", "").split(",") if s]
    return order + sorted(k[len(T.STATE_PREFIX):] for k in tags
                          if k.startswith(T.STATE_PREFIX) and k[len(T.STATE_PREFIX):] not in order)


def runs_table(runs) -> Table:
    """Recent pipeline runs: id, name and start, status, each stage's state in DAG order
    (one per line, so the table fits 80 columns)."""
    table = _table("pipeline runs", [("run id", KEEP), ("name / started", {"no_wrap": True,
                                                                          "overflow": "ellipsis"}),
                                     ("status", KEEP), ("stages", KEEP)])
    for run in runs:
        tags = run.data.tags
        states = Text("\n").join(
            Text.assemble(f"{name} ", (tags.get(T.STATE_PREFIX + name, "pending"),
                                       STYLE.get(tags.get(T.STATE_PREFIX + name, ""), "")))
            for name in stage_order(tags))
        started = time.strftime("%m-%d %H:%M", time.localtime(run.info.start_time / 1000))
        table.add_row(run.info.run_id, Text(f"{run.info.run_name or ''}\n{started}"), run.info.status,
                      states)
    return table


def results_lines(states: Mapping) -> list[Text]:
    """Headline outputs of each stage, never cut: a path (or any value with a `/`) on a
    line of its own, the stage's numbers and short values together on one line that
    wraps at spaces. Print with soft_wrap so a long path is never shortened or folded."""
    lines = [Text("stage outputs", style="bold")]
    for st in states.values():
        short, paths = [], []
        for key, value in (st.result or {}).items():
            if isinstance(value, dict) and key == "metrics":
                short += [f"{k}={_num_or_text(v)}" for k, v in value.items()
                          if isinstance(v, (int, float, str, bool)) and "/" not in str(v)][:10]
            elif isinstance(value, str) and "/" in value:
                paths.append(f"{key}={value}")
            elif isinstance(value, (int, float, str, bool)):
                short.append(f"{key}={_num_or_text(value)}")
        if short:
            lines.append(Text.assemble((f"{st.name}: ", "bold"), " ".join(short[:18])))
        lines += [Text.assemble((f"{st.name}: ", "bold"), p) for p in paths]
    return lines


def _num_or_text(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."  # fits an 80-column table


def compare(client, run_a: str, run_b: str) -> dict:
    """Two pipeline runs side by side: headline metrics, differing params, stage states.

    Returns:
        {"runs": [a, b], "metrics": [[key, a, b, b - a | None]],
         "params": [[key, a, b]] (only differing), "stages": [[stage, state a, state b]]}.
    """
    runs = [T.get_pipeline_run(client, rid) for rid in (run_a, run_b)]
    ma, mb = (r.data.metrics for r in runs)
    metrics = []
    for key in sorted(set(ma) | set(mb)):
        a, b = ma.get(key), mb.get(key)
        metrics.append([key, a, b, (b - a) if a is not None and b is not None else None])
    pa, pb = (r.data.params for r in runs)
    params = [[k, pa.get(k), pb.get(k)] for k in sorted(set(pa) | set(pb)) if pa.get(k) != pb.get(k)]
    order = stage_order(runs[0].data.tags)
    order += [s for s in stage_order(runs[1].data.tags) if s not in order]
    stages = [[s, *(r.data.tags.get(T.STATE_PREFIX + s, "-") for r in runs)] for s in order]
    timing = [[s, *(r.data.metrics.get(f"{s}.{k}") for r in runs for k in ("est_seconds", "seconds"))]
              for s in [*order, "pipeline"]]
    return {"runs": [r.info.run_id for r in runs], "metrics": metrics, "params": params,
            "stages": stages, "timing": [t for t in timing if any(v is not None for v in t[1:])]}


def compare_tables(info: dict) -> list[Table]:
    """`moeflow runs --compare A B`: metrics (with B - A), params that differ, stage states,
    each stage's dry-run estimate beside what it measured."""
    a, b = info["runs"]
    head = [("A", {**KEEP, "justify": "right"}), ("B", {**KEEP, "justify": "right"})]
    metrics = _table(f"A = {a}\nB = {b}\nheadline metrics",
                     [("metric", TEXT), *head, ("B - A", {**KEEP, "justify": "right"})])
    for key, va, vb, delta in info["metrics"]:
        metrics.add_row(key, _num(va), _num(vb), "" if delta is None else f"{delta:+.4g}")
    params = _table("params that differ", [("param", TEXT), ("A", TEXT), ("B", TEXT)])
    for key, va, vb in info["params"]:
        params.add_row(key, _short(va if va is not None else "-"), _short(vb if vb is not None else "-"))
    stages = _table("stages", [("stage", KEEP), ("A", KEEP), ("B", KEEP)])
    for name, sa, sb in info["stages"]:
        stages.add_row(name, sa, sb)
    return [metrics, params, stages, timing_table(info["timing"])]


def timing_table(rows: list[list]) -> Table:
    """Seconds per stage: the dry run's estimate recorded when each run started, what the
    stage measured (absent when reused), and measured / estimated."""
    right = {**KEEP, "justify": "right"}
    t = _table("estimated vs measured seconds (est: the dry run at the run's start)",
               [("stage", KEEP), *[(c, right) for c in ("A est", "A s", "A x", "B est", "B s", "B x")]])
    for name, ea, sa, eb, sb in rows:
        t.add_row(name, _num(ea), _num(sa), _ratio(sa, ea), _num(eb), _num(sb), _ratio(sb, eb))
    return t


def _ratio(measured, estimated) -> str:
    return "-" if measured is None or not estimated else f"{measured / estimated:.2f}"


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"
