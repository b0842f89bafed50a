"""`moeflow operators CONFIG` and `moeflow eplb LOAD`.

    moeflow operators configs/demo.yaml          # the stage (and convert, plan) through the DAG
    moeflow eplb load.json --ep 32 --redundant 32 --nodes 4 --groups 8
    moeflow eplb load.npy --ep 32 --redundant 32 --json > placement.json

LOAD is a `.json` ([layers][experts] token counts, or an operators stage's
expert_load.json with a "counts" key) or a `.npy` array. `eplb` prints the
balancedness (mean/max tokens per rank) per layer before (contiguous experts,
no replicas) and after the placement; with --json it prints
{"balancedness_before", "balancedness_after", "layers": [{"layer", "before", "after"}],
 "physical_to_logical"}. Exit codes: 0 ok, 1 the stage failed, 2 bad input.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from moeflow.errors import UserError
from workflows.printer import make_console


def read_load(path: str):
    """[layers, experts] float64 array from a .json or .npy file (UserError naming the file)."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    import numpy as np

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such load file")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except ValueError as exc:
            raise UserError(f"{path}: not a numeric .npy array ({exc})") from None
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        data = data.get("counts") if isinstance(data, dict) else data
        try:
            arr = np.asarray(data, dtype=np.float64)
        except (TypeError, ValueError):
            raise UserError(f"{path}: expected a layers x experts list of number rows of equal length") from None
    else:
        raise UserError(f"{path}: expected a .json or .npy load file")
    if arr.dtype.kind not in "iuf":
        raise UserError(f"{path}: expected numbers, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise UserError(f"{path}: expected a layers x experts matrix, got shape {list(arr.shape)}")
    return arr.astype(np.float64)


def eplb(load: str = typer.Argument(..., help=".json or .npy [layers][experts] token counts"),
         ep: int = typer.Option(..., "--ep", help="expert-parallel ranks (GPUs)"),
         redundant: int = typer.Option(0, "--redundant", help="redundant expert slots (replicas)"),
         nodes: int = typer.Option(1, "--nodes", help="nodes the EP ranks span"),
         groups: int = typer.Option(1, "--groups", help="expert groups (hierarchical when nodes divide them)"),
         as_json: bool = typer.Option(False, "--json", help="print the placement as JSON")):
    """Place experts and their replicas on EP ranks; balancedness per layer before/after."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.operators import eplb as E

    weight = read_load(load)
    if redundant < 0:
        raise UserError(f"--redundant {redundant}: must be >= 0")
    start = time.perf_counter()
    phy2log, _, logcnt = E.rebalance_experts(weight, weight.shape[1] + redundant, groups, nodes, ep)
    seconds = time.perf_counter() - start
    summary = E.summary(weight, phy2log, logcnt, ep)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    console = make_console(width=120)
    mode = "hierarchical" if groups % nodes == 0 and nodes > 1 else "global"
    table = Table(title=f"EPLB {mode}: {weight.shape[0]} layers x {weight.shape[1]} experts, "
                        f"EP {ep}, {redundant} redundant, {nodes} node(s), {groups} group(s)")
    for col in ("layer", "before", "after"):
        table.add_column(col, justify="right")
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for row in summary["layers"]:
        table.add_row(str(row["layer"]), fmt(row["before"]), fmt(row["after"]))
    table.add_row("mean", fmt(summary["balancedness_before"]), fmt(summary["balancedness_after"]))
    console.print(table)
    console.print(f"balancedness (mean/max tokens per rank) {fmt(summary['balancedness_before'])} -> "
                  f"{fmt(summary['balancedness_after'])} in {seconds:.2f} s")


def operators(config: str = typer.Argument(..., help="pipeline YAML (see configs/)"),
              set_: Optional[list[str]] = typer.Option(
                  None, "--set", help="override a config key, e.g. --set operators.ep_size=2"),
              no_cache: bool = typer.Option(False, "--no-cache",
                                            help="rerun operators even if a cached result exists")):
    """Expert-load profile, EPLB placement and experts-kernel choice for the config's model."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.config import load_config
    from workflows import report
    from workflows.runner import run_pipeline

    console = make_console(width=160)
    cfg = load_config(config, set_ or [])
    outcome = run_pipeline(cfg, targets=["operators"], rerun=("operators",) if no_cache else (),
                           on_event=report.event_printer(console))
    console.print(report.stage_table(outcome.stages, title=f"pipeline run {outcome.run_id}"))
    state = outcome.stages.get("operators")
    if outcome.status != "FINISHED" or state is None or not state.result:
        console.print(f"operators did not finish; resume with: moeflow resume {outcome.run_id}")
        raise typer.Exit(1)
    r = state.result
    chosen = r["experts_implementation"]
    console.print(f"experts implementation: training {chosen['training']}, serving {chosen['serving']}")
    console.print(f"balancedness at EP {r['ep_size']}: {r['balancedness_before']} -> {r['balancedness_after']}"
                  f"; permuted checkpoint: {r['model_path'] if r['placement_applied'] else 'not applied'}")
    console.print(f"operators.json: {r['operators_path']}")


def register(app: typer.Typer) -> None:
    app.command(name="eplb")(eplb)
    app.command(name="operators")(operators)
