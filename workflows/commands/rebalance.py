"""`moeflow rebalance`: re-place experts from the running deployment's live load
(moeflow/ops/rebalance.py) and roll the re-placed checkpoint out.

    moeflow rebalance --run RUN_ID --address RAY_ADDRESS [--window 300] [--dry-run]
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


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
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: joining Ray and the placement; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import rebalance as action

    action.rebalance(**options)


def register(app: typer.Typer) -> None:
    app.command("rebalance")(rebalance_cmd)
