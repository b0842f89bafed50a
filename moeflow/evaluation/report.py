"""Comparison tables: metric, baseline, candidate, delta, threshold, verdict."""

from __future__ import annotations

from typing import IO, cast

from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

from moeflow.evaluation.baseline import Row

_STYLE = {"FAIL": "bold red", "pass": "green", "better": "bold green", "info": "dim",
          "skipped": "yellow", "new": "cyan"}


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.2e}"


def diff_table(rows: list[Row], title: str, reference: str = "baseline",
               candidate: str = "candidate") -> Table:
    """A rich table of comparison rows (failures in red).

    Args:
        rows: comparison rows (baseline.compare / check_gain).
        title: table title; reference / candidate: column headers.
    """
    table = Table(title=title, title_justify="left")
    for col, justify in (("task", "left"), ("metric", "left"), (reference, "right"),
                         (candidate, "right"), ("delta", "right"), ("threshold", "right"),
                         ("rule", "left"), ("verdict", "left"), ("note", "left")):
        table.add_column(col, justify=cast(JustifyMethod, justify))
    for r in rows:
        delta = "-" if r.delta is None else f"{r.delta:+.4g}"
        table.add_row(r.task, r.metric, _num(r.reference), _num(r.candidate), delta,
                      _num(r.threshold), r.rule, Text(r.verdict, style=_STYLE.get(r.verdict, "")),
                      r.note)
    return table


def gate_table(sections, title: str) -> Table:
    """One table of every model against every reference (gate.Section list):
    a `model vs` column, then diff_table's columns."""
    table = Table(title=title, title_justify="left")
    for col, justify in (("model vs", "left"), ("task", "left"), ("metric", "left"),
                         ("reference", "right"), ("candidate", "right"), ("delta", "right"),
                         ("threshold", "right"), ("rule", "left"), ("verdict", "left"),
                         ("note", "left")):
        table.add_column(col, justify=cast(JustifyMethod, justify))
    for sec in sections:
        for i, r in enumerate(sec.rows):
            delta = "-" if r.delta is None else f"{r.delta:+.4g}"
            table.add_row(sec.title if i == 0 else "", r.task, r.metric, _num(r.reference),
                          _num(r.candidate), delta, _num(r.threshold), r.rule,
                          Text(r.verdict, style=_STYLE.get(r.verdict, "")), r.note,
                          end_section=i == len(sec.rows) - 1)
    return table


def render_text(table: Table, width: int = 200) -> str:
    """Plain-text rendering of a table (for logs, MLflow artifacts, error context)."""
    console = Console(width=width, record=True, file=cast(IO[str], _Null()),  # rich only writes and flushes it
                      color_system=None, markup=False)
    console.print(table)
    return console.export_text()


def failure_summary(rows: list[Row], label: str) -> str:
    """One line naming every failed metric, for a UserError."""
    bad = [r for r in rows if r.failed]
    parts = [f"{r.task}/{r.metric} {_num(r.reference)} -> {_num(r.candidate)} "
             f"(delta {r.delta:+.4g}, threshold {_num(r.threshold)}"
             + (f", rule {r.rule}" if r.rule else "") + ")"
             + (f" [{r.note}]" if r.note else "") for r in bad]
    return f"{len(bad)} check(s) regressed vs {label}: " + "; ".join(parts)


class _Null:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def metrics_table(result: dict, title: str) -> Table:
    """A rich table of one result: task, metric, value, stderr, n (or the skip note)."""
    table = Table(title=title, title_justify="left")
    for col, justify in (("task", "left"), ("metric", "left"), ("value", "right"),
                         ("stderr", "right"), ("n", "right"), ("note", "left")):
        table.add_column(col, justify=cast(JustifyMethod, justify))
    for name, task in result["tasks"].items():
        if "metrics" not in task:
            table.add_row(name, "-", "-", "-", "-", Text(str(task.get("skipped", "")), style="yellow"))
            continue
        for metric, m in task["metrics"].items():
            table.add_row(name, metric, _num(m["value"]), _num(m["stderr"]), str(task["n"]),
                          "" if m["gate"] else "not gated")
    return table
