"""`moeflow watch`: gate every new registered model version (moeflow/ops/watch.py).

    moeflow watch [--model NAME ...] [--once] [--interval 10] [--webhook URL]
    moeflow watch --address http://HEAD:8265 [...]    # the same, as a Ray Job on the cluster
    moeflow watch --regate models:/demo-adapter/6 --once   # gate a version again (e.g. after
                                                           # setting its base_dir tag)

Exit codes: 0 (with --once: every verdict PASS), 1 a version FAILED (--once), 2 bad input.

As a Ray Job the watcher outlives the shell that started it. Its state is the registry's verdict
tags in MLflow, so a watcher that died is restarted by submitting it again: it gates what is
still pending and nothing twice. One runs per verdict experiment: a second submission while one
runs is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def watch_cmd(
    model: Optional[list[str]] = typer.Option(None, "--model",
                                              help="registered model to watch (repeatable; default: all)"),
    once: bool = typer.Option(False, "--once", help="gate what is pending, then exit"),
    interval: float = typer.Option(10.0, min=0.5, help="seconds between registry polls"),
    suite: Optional[str] = typer.Option(None, help="suite YAML (default: the shipped golden suite)"),
    webhook: Optional[str] = typer.Option(None, help="POST a JSON notification here on FAIL "
                                          "(default $MOEFLOW_WATCH_WEBHOOK)"),
    experiment: str = typer.Option("moeflow-watch", help="MLflow experiment of the verdict runs"),
    tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI"),
    dtype: str = typer.Option("float32", help="compute dtype"),
    address: Optional[str] = typer.Option(None, help="run as a Ray Job on this cluster (dashboard "
                                          "address, e.g. http://HEAD:8265) and return"),
    regate: Optional[list[str]] = typer.Option(None, "--regate", help="models:/NAME/VERSION to gate "
                                               "again, whatever its verdict (repeatable)"),
    runtime_env: Path = typer.Option(Path(__file__).resolve().parents[2] / "cluster" / "runtime_env.yaml",
                                     help="with --address: the job's runtime_env YAML"),
):
    """Gate every new registered model version against its base and its lineage's last PASS."""
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: the watcher loads MLflow and the evaluation; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import watch as action

    action.watch(**options)


def register(app: typer.Typer) -> None:
    app.command("watch")(watch_cmd)
