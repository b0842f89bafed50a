"""Calibration/compare report: terminal table (first red row highlighted), per-layer
plot, MLflow logging."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # rich is imported where a table is drawn
    from rich.console import JustifyMethod

_STYLE = {"pass": "green", "warning": "yellow", "error": "red"}


def _num(x, fmt: str = ".6f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return format(x, fmt)


def table(report: dict, title: str):
    """A rich Table of the report's rows; the first divergent row in reverse red."""

    t = Table(title=title, title_justify="left")
    for col, just in (("layer", "left"), ("kind", "left"), ("Cosine", "right"),
                      ("MaxAbsErr", "right"), ("MaxRelativeErr", "right"),
                      ("One Thousandth Err Ratio", "right"), ("router top-k overlap", "right"),
                      ("status", "left"), ("propagated Cosine", "right"), ("propagated", "left")):
        t.add_column(col, justify=cast("JustifyMethod", just))
    first = report.get("first_divergent")
    for row in report["layers"]:
        prop = row["propagated"]
        style = "bold reverse red" if row["name"] == first else None
        t.add_row(row["name"], row["kind"], _num(row["cosine"]), _num(row["max_abs"], ".4g"),
                  _num(row["max_rel"], ".4g"), _num(row["one_thousandth_err_ratio"], ".4f"),
                  _num(row["router_topk_overlap"], ".4f"),
                  Text(row["status"], style=_STYLE[row["status"]]), _num(prop["cosine"]),
                  Text(prop["status"], style=_STYLE[prop["status"]]), style=style)
    return t


def headline(report: dict) -> str:
    first = report.get("first_divergent")
    final = report["final"]
    head = f"first divergent layer: {first}" if first else "no divergent layer (isolated mode)"
    kept = (report.get("precision_plan") or {}).get("added") or []
    plan = f"; kept in high precision by the plan: {', '.join(kept)}" if kept else ""
    return (f"{head}; final logits cosine {final['logits_cosine']:.6f}, "
            f"greedy top-1 agreement {final['top1_agreement']:.4f}{_ties(final)}{plan}")


def _ties(final: dict) -> str:
    n = final.get("top1_near_ties") or 0
    return f" ({n} near-tie flip(s) counted as agreeing)" if n else ""


def render_text(report: dict, title: str) -> str:
    """Headline + table as plain text (for MLflow and files)."""

    console = Console(record=True, width=200, file=open("/dev/null", "w"), color_system=None, markup=False)
    console.print(headline(report))
    console.print(table(report, title))
    return console.export_text()


def plot(report: dict, path: str | Path):
    """1 - cosine per row (log scale), isolated and propagated, with msprobe's cosine
    thresholds; the first divergent row marked. Returns the figure."""
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib

    matplotlib.use("Agg")  # headless: Ray workers have no display
    import matplotlib.pyplot as plt

    rows = report["layers"]
    x = list(range(len(rows)))

    def gap(c):
        return max(1.0 - c, 1e-9) if c is not None and not math.isnan(c) else 1.0

    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows) + 2), 4.5))
    ax.semilogy(x, [gap(r["cosine"]) for r in rows], "o-", label="isolated")
    ax.semilogy(x, [gap(r["propagated"]["cosine"]) for r in rows], "s--", label="propagated")
    ax.axhline(1 - 0.99, color="orange", linestyle=":", label="cosine 0.99")
    ax.axhline(1 - 0.9, color="red", linestyle=":", label="cosine 0.9")
    first = report.get("first_divergent")
    if first:
        i = next(i for i, r in enumerate(rows) if r["name"] == first)
        ax.axvline(i, color="red", alpha=0.4, label=f"first divergent: {first}")
    ax.set_xticks(x)
    ax.set_xticklabels([r["name"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("1 - cosine")
    ax.set_title(f"per-layer divergence ({report.get('scheme') or 'compare'})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def log_mlflow(report: dict, text: str, fig, prefix: str = "calibrate") -> None:
    """Report JSON, table and plot as artifacts, headline numbers as metrics (active run only)."""
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.log_dict(report, f"{prefix}/report.json")
    mlflow.log_text(text, f"{prefix}/table.txt")
    mlflow.log_figure(fig, f"{prefix}/layers.png")
    mlflow.log_metrics({f"{prefix}.logits_cosine": report["final"]["logits_cosine"],
                        f"{prefix}.top1_agreement": report["final"]["top1_agreement"],
                        f"{prefix}.errors": sum(r["status"] == "error" for r in report["layers"]),
                        f"{prefix}.kept_modules": len(report.get("precision_plan", {}).get("added", []))})
    mlflow.set_tag("moeflow.first_divergent", report.get("first_divergent") or "none")
