"""`moeflow operators CONFIG` and `moeflow eplb LOAD`.

    moeflow operators configs/demo.yaml          # = moeflow run CONFIG, operators as its target
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

import typer
from rich.console import Console

from workflows.commands.stage import stage_command


def eplb(load: str = typer.Argument(..., help=".json or .npy [layers][experts] token counts"),
         ep: int = typer.Option(..., "--ep", help="expert-parallel ranks (GPUs)"),
         redundant: int = typer.Option(0, "--redundant", help="redundant expert slots (replicas)"),
         nodes: int = typer.Option(1, "--nodes", help="nodes the EP ranks span"),
         groups: int = typer.Option(1, "--groups", help="expert groups (hierarchical when nodes divide them)"),
         as_json: bool = typer.Option(False, "--json", help="print the placement as JSON")):
    """Place experts and their replicas on EP ranks; balancedness per layer before/after."""
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: numpy and the placement; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import operators as action

    action.eplb(**options)


def show(console: Console, r: dict) -> None:
    """The experts implementation chosen, the balancedness before/after, where the files are."""
    chosen = r["experts_implementation"]
    console.print(f"experts implementation: training {chosen['training']}, serving {chosen['serving']}")
    console.print(f"balancedness at EP {r['ep_size']}: {r['balancedness_before']} -> {r['balancedness_after']}"
                  f"; permuted checkpoint: {r['model_path'] if r['placement_applied'] else 'not applied'}")
    console.print(f"operators.json: {r['operators_path']}")


operators = stage_command("operators", show,
                          "Expert-load profile, EPLB placement and experts-kernel choice for the config's model.",
                          "operators.ep_size=2")


def register(app: typer.Typer) -> None:
    app.command(name="eplb")(eplb)
    app.command(name="operators")(operators)
