"""`moeflow watch`: gate every new registered model version (moeflow/ops/watch.py).

    moeflow watch [--model NAME ...] [--once] [--interval 10] [--webhook URL]

Exit codes: 0 (with --once: every verdict PASS), 1 a version FAILED (--once), 2 bad input.
"""

from __future__ import annotations

import os
from typing import Optional

import typer
from rich.text import Text

from workflows.printer import make_console


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
):
    """Gate every new registered model version against its base and its lineage's last PASS."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.errors import UserError
    from moeflow.ops.watch import WatchSettings, watch
    from moeflow.tracking import resolve_tracking_uri

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype {dtype!r}: use float32, bfloat16 or float16")
    console = make_console()
    settings = WatchSettings(tracking_uri=resolve_tracking_uri(tracking_uri), models=list(model or []),
                             suite=suite, experiment=experiment, dtype=dtype,
                             webhook=webhook or os.environ.get("MOEFLOW_WATCH_WEBHOOK") or None)

    def show(rec: dict) -> None:
        color = "green" if rec["verdict"] == "PASS" else "red"
        console.print(Text.assemble(f"models:/{rec['model']}/{rec['version']}: ", (rec["verdict"], color),
                                    f" vs {rec['reference']} ({rec['seconds']:.0f} s, run {rec['run_id']}): "
                                    f"{rec['reason']}"), soft_wrap=True)
        if rec["verdict"] == "FAIL" and rec["table"]:
            console.print(rec["table"], soft_wrap=True)

    if not once:
        console.print(f"watching {', '.join(settings.models) or 'every registered model'} in "
                      f"{settings.tracking_uri} every {interval:g} s; Ctrl-C stops")
    done = watch(settings, once=once, interval_s=interval, on_verdict=show)
    if once and any(r["verdict"] == "FAIL" for r in done):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("watch")(watch_cmd)
