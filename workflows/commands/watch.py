"""`moeflow watch`: gate every new registered model version (moeflow/ops/watch.py).

    moeflow watch [--model NAME ...] [--once] [--interval 10] [--webhook URL]
    moeflow watch --address http://HEAD:8265 [...]    # the same, as a Ray Job on the cluster

Exit codes: 0 (with --once: every verdict PASS), 1 a version FAILED (--once), 2 bad input.

As a Ray Job the watcher outlives the shell that started it. Its state is the registry's verdict
tags in MLflow, so a watcher that died is restarted by submitting it again: it gates what is
still pending and nothing twice. One runs per verdict experiment: a second submission while one
runs is refused, naming it.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
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
    address: Optional[str] = typer.Option(None, help="run as a Ray Job on this cluster (dashboard "
                                          "address, e.g. http://HEAD:8265) and return"),
    runtime_env: Path = typer.Option(Path(__file__).resolve().parents[2] / "cluster" / "runtime_env.yaml",
                                     help="with --address: the job's runtime_env YAML"),
):
    """Gate every new registered model version against its base and its lineage's last PASS."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.errors import UserError
    from moeflow.ops.watch import WatchSettings, watch
    from moeflow.tracking import resolve_tracking_uri

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype {dtype!r}: use float32, bfloat16 or float16")
    console = make_console()
    if address:
        args = [f"--model={m}" for m in model or []] + (["--once"] if once else [])
        args += [f"--interval={interval}", f"--experiment={experiment}", f"--dtype={dtype}",
                 f"--tracking-uri={resolve_tracking_uri(tracking_uri)}"]
        args += [f"--suite={suite}"] if suite else []
        args += [f"--webhook={webhook}"] if webhook else []
        _submit(console, address, runtime_env, experiment, args)
        return
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


def _submit(console, address: str, runtime_env: Path, experiment: str, args: list[str]) -> None:
    """`moeflow watch ARGS` as a Ray Job (one per verdict experiment)."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.errors import UserError
    from workflows.submit import job_env, running_jobs, submit_job

    running = running_jobs(address, "moeflow.watch", experiment)
    if running:
        raise UserError(f"a watcher of experiment {experiment!r} already runs on {address}: job "
                        f"{running[0]} (stop it first: ray job stop {running[0]} --address {address})")
    entrypoint = "python -m workflows.cli watch " + " ".join(shlex.quote(a) for a in args)
    _, job_id = submit_job(address, entrypoint, job_env(runtime_env),
                           f"moeflow-watch-{experiment}-{int(time.time())}", {"moeflow.watch": experiment})
    console.print(f"submitted watcher job {job_id} to {address}; logs: ray job logs -f {job_id} "
                  f"--address {address}")


def register(app: typer.Typer) -> None:
    app.command("watch")(watch_cmd)
