"""`moeflow calibrate CONFIG` and `moeflow compare A B`.

    moeflow calibrate configs/demo.yaml --set calibrate.scheme=w8a16
    moeflow compare demo-work/model out/quantized              # the same table, any two checkpoints
    moeflow compare A B --golden configs/suites/golden.yaml --json

`calibrate` is `moeflow run CONFIG` with `calibrate` as its target (its upstream cached)
and prints the per-layer table. `compare` runs the golden set through two
checkpoints of one architecture, one decoder layer at a time, and prints the
per-layer table with the first divergent layer (isolated mode) on top.
Exit codes: 0 ok, 1 the stage failed / compare found an error row, 2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from workflows.commands.stage import stage_command


def show(console: Console, result: dict) -> None:
    """The per-layer table of the calibrated checkpoint against its source."""
    # lazy: the report's table needs the quantisation modules; `moeflow --help` loads none of them
    from workflows.actions.calibrate import print_report

    rep = json.loads(Path(result["report_path"]).read_text())
    print_report(console, rep, f"calibrate {result['scheme']}: {result['checkpoint']}")


calibrate = stage_command("calibrate", show,
                          "Quantise the config's model, compare it layer by layer, plan precision (MLflow-tracked).",
                          "calibrate.scheme=w8a16")


def compare(a: str = typer.Argument(..., help="baseline checkpoint dir"),
            b: str = typer.Argument(..., help="candidate checkpoint dir (same architecture)"),
            golden: Optional[str] = typer.Option(None, "--golden",
                                                 help="suite YAML (default: the shipped golden suite)"),
            samples: int = typer.Option(64, min=1, help="golden records used"),
            max_tokens: int = typer.Option(64, min=1, help="text samples cut to this many tokens"),
            shards: int = typer.Option(1, min=1, help="Ray tasks to split the golden set over"),
            json_: bool = typer.Option(False, "--json", help="print the report as JSON"),
            plot: Optional[Path] = typer.Option(None, help="also write the per-layer plot here (PNG)")):
    """Compare two checkpoints layer by layer on the golden set (msprobe's metrics)."""
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: the comparison loads torch and transformers; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import calibrate as action

    action.compare(**options)


def register(app: typer.Typer) -> None:
    """Add `moeflow calibrate` and `moeflow compare` to the CLI."""
    app.command(name="calibrate")(calibrate)
    app.command(name="compare")(compare)
