"""`moeflow rebalance`: re-place experts from the running deployment's live load
(moeflow/ops/rebalance.py) and roll the re-placed checkpoint out.

    moeflow rebalance --run RUN_ID --address RAY_ADDRESS [--window 300] [--dry-run]
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from workflows.printer import make_console


def print_report(console: Console, report: dict) -> None:
    bal = report["balancedness"]
    table = Table(title=f"balancedness (mean/max tokens per rank), EP {report['ep_size']}, live load "
                        f"of {len(report['replicas'])} replica(s) over {report['window_s']:.0f} s")
    for col in ("MoE layer", "served", "operators stage", "re-placed"):
        table.add_column(col)
    for i, (a, b, c) in enumerate(zip(bal["served"], bal["operators"], bal["replaced"])):
        table.add_row(f"{i}{' (hottest)' if i == report['hottest_layer'] else ''}", f"{a:.3f}", f"{b:.3f}",
                      f"{c:.3f}")
    console.print(table)
    files = report["files"]
    console.print(f"vLLM: {files['vllm']}   SGLang: {files['sglang']}   live load: {files['expert_load']}")
    if report.get("applied"):
        r = report["rollout"]
        console.print(f"rolled out {report['model_path']} in {r['seconds']:.0f} s ({'; '.join(r['steps'])})")
    elif report.get("reason"):
        console.print(f"not rolled out: {report['reason']}")


def rebalance_cmd(
    run: str = typer.Option(..., "--run", help="pipeline run whose deployment to re-place (its operators stage)"),
    address: Optional[str] = typer.Option(None, help="Ray address of the deployment (default $RAY_ADDRESS)"),
    window: float = typer.Option(300.0, min=1, help="seconds of live load to sum"),
    ep_size: Optional[int] = typer.Option(None, min=1, help="EP size to place for (default: the operators stage's)"),
    out: Optional[Path] = typer.Option(None, help="output dir (default rebalance-<time>/ here)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="compute and write the placement, roll nothing out"),
    tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI"),
):
    """Re-place experts from the live load of the running deployment; rolling update."""

    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    import ray

    from moeflow import tracking as T
    from moeflow.errors import UserError
    from moeflow.ops.rebalance import rebalance
    from workflows.raylocal import join_ray

    console = make_console()
    addr = address or os.environ.get("RAY_ADDRESS")
    joined = ray.is_initialized()
    if not addr and not joined:
        raise UserError("rebalance acts on a running deployment: name its Ray cluster with --address "
                        "(or $RAY_ADDRESS; `moeflow deploy` / `serve` print it)")
    T.get_pipeline_run(T.client_for(T.existing_tracking_uri(tracking_uri)), run)  # before joining Ray
    out = (out or Path(f"rebalance-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()
    if addr and not joined:
        join_ray(addr)
    report = rebalance(run, tracking_uri=tracking_uri, out=out, window_s=window, apply=not dry_run,
                       ep_size=ep_size, notify=console.print)
    print_report(console, report)


def register(app: typer.Typer) -> None:
    app.command("rebalance")(rebalance_cmd)
