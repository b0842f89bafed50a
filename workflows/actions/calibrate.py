"""What `moeflow compare` does, and the calibrate command's report (workflows/commands/calibrate.py
declares what they take): two checkpoints compared layer by layer on the golden set."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from moeflow.core.errors import UserError
from moeflow.evaluation.suite import load_suite
from moeflow.quant.compare import check_same_architecture, compare_checkpoints
from moeflow.quant.golden import golden_samples
from moeflow.quant.report import headline, table
from moeflow.quant.report import plot as draw
from workflows.printer import make_console
from workflows.raylocal import ray_session


def print_report(console: Console, rep: dict, title: str) -> None:
    console.print(headline(rep), style="bold")
    console.print(table(rep, title))


def compare(a: str, b: str, golden: str | None, samples: int, max_tokens: int, shards: int, json_: bool,
            plot: Path | None) -> None:
    """Compare, print the table (or JSON), draw the plot; exit 1 at a divergent layer."""
    for path in (a, b):
        if not Path(path, "config.json").is_file():
            raise UserError(f"{path}: not a checkpoint directory (no config.json)")
    check_same_architecture(a, b)
    inputs = golden_samples(load_suite(golden), a, limit=samples, max_tokens=max_tokens)
    if shards > 1:
        with ray_session(None):
            rep = compare_checkpoints(a, b, inputs, shards=shards)
    else:
        rep = compare_checkpoints(a, b, inputs)
    rep = {"baseline": a, "candidate": b, "samples": len(inputs), **rep}
    if plot:
        draw(rep, plot)
    if json_:
        print(json.dumps(rep, indent=2))
    else:
        console = make_console(width=200)
        print_report(console, rep, f"compare {a} -> {b}")
    if rep["first_divergent"]:
        raise typer.Exit(1)
