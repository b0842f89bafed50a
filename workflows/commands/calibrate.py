"""`moeflow calibrate CONFIG` and `moeflow compare A B`.

    moeflow calibrate configs/demo.yaml --set calibrate.scheme=w8a16
    moeflow compare demo-work/model out/quantized              # the same table, any two checkpoints
    moeflow compare A B --golden configs/suites/golden.yaml --json

`calibrate` runs the `calibrate` stage of the DAG (and its cached upstream) and
prints the per-layer table. `compare` runs the golden set through two
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

from workflows.printer import make_console


def calibrate(config: str = typer.Argument(..., help="pipeline YAML (see configs/)"),
              set_: Optional[list[str]] = typer.Option(
                  None, "--set", help="override a config key, e.g. --set calibrate.scheme=w8a16"),
              no_cache: bool = typer.Option(False, "--no-cache",
                                            help="rerun calibrate even if a cached result exists")):
    """Quantise the config's model, compare it layer by layer, plan precision (MLflow-tracked)."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.config import load_config
    from workflows import report
    from workflows.runner import run_pipeline

    console = make_console(width=200)
    cfg = load_config(config, set_ or [])
    outcome = run_pipeline(cfg, targets=["calibrate"], rerun=("calibrate",) if no_cache else (),
                           on_event=report.event_printer(console))
    console.print(report.stage_table(outcome.stages, title=f"pipeline run {outcome.run_id}"))
    state = outcome.stages.get("calibrate")
    if outcome.status != "FINISHED" or state is None or not state.result:
        console.print(f"calibrate did not finish; resume with: moeflow resume {outcome.run_id}")
        raise typer.Exit(1)
    _print_report(console, json.loads(Path(state.result["report_path"]).read_text()),
                  f"calibrate {state.result['scheme']}: {state.result['checkpoint']}")


def _print_report(console: Console, rep: dict, title: str) -> None:
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.quant.report import headline, table

    console.print(headline(rep), style="bold")
    console.print(table(rep, title))


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
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.evaluation.suite import load_suite
    from moeflow.quant.compare import check_same_architecture, compare_checkpoints
    from moeflow.quant.golden import golden_samples

    for path in (a, b):
        if not Path(path, "config.json").is_file():
            # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
            from moeflow.errors import UserError
            raise UserError(f"{path}: not a checkpoint directory (no config.json)")
    check_same_architecture(a, b)
    inputs = golden_samples(load_suite(golden), a, limit=samples, max_tokens=max_tokens)
    if shards > 1:
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from workflows.raylocal import ray_session

        with ray_session(None):
            rep = compare_checkpoints(a, b, inputs, shards=shards)
    else:
        rep = compare_checkpoints(a, b, inputs)
    rep = {"baseline": a, "candidate": b, "samples": len(inputs), **rep}
    if plot:
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from moeflow.quant.report import plot as draw

        draw(rep, plot)
    if json_:
        print(json.dumps(rep, indent=2))
    else:
        console = make_console(width=200)
        _print_report(console, rep, f"compare {a} -> {b}")
    if rep["first_divergent"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `moeflow calibrate` and `moeflow compare` to the CLI."""
    app.command(name="calibrate")(calibrate)
    app.command(name="compare")(compare)
