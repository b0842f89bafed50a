"""What `moeflow rebalance` does (workflows/commands/rebalance.py declares what it takes): re-place
experts from a running deployment's live load and roll the placement out."""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray
from rich.console import Console
from rich.table import Table

from moeflow.core import tracking as T
from moeflow.core.errors import UserError
from moeflow.ops.rebalance import rebalance as replace_experts
from workflows.printer import make_console
from workflows.raylocal import join_ray


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


def rebalance(run: str, address: str | None, window: float, ep_size: int | None, out: Path | None,
              dry_run: bool, tracking_uri: str | None) -> None:
    """Join the deployment's Ray cluster, sum its live load, place and (unless dry_run) roll out."""
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
    report = replace_experts(run, tracking_uri=tracking_uri, out=out, window_s=window, apply=not dry_run,
                       ep_size=ep_size, notify=console.print)
    print_report(console, report)
