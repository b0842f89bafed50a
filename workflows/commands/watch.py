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
    regate: Optional[list[str]] = typer.Option(None, "--regate", help="models:/NAME/VERSION to gate "
                                               "again, whatever its verdict (repeatable)"),
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
    models = list(model or [])
    if regate:  # before a submission too: the job then finds them pending
        names = _regate(resolve_tracking_uri(tracking_uri), regate, console)
        models += [n for n in names if models and n not in models]
    if address:
        args = [f"--model={m}" for m in models] + (["--once"] if once else [])
        args += [f"--interval={interval}", f"--experiment={experiment}", f"--dtype={dtype}",
                 f"--tracking-uri={resolve_tracking_uri(tracking_uri)}"]
        args += [f"--suite={suite}"] if suite else []
        args += [f"--webhook={webhook}"] if webhook else []
        _submit(console, address, runtime_env, experiment, args)
        return
    settings = WatchSettings(tracking_uri=resolve_tracking_uri(tracking_uri), models=models,
                             suite=suite, experiment=experiment, dtype=dtype,
                             webhook=webhook or os.environ.get("MOEFLOW_WATCH_WEBHOOK") or None)

    def show(rec: dict) -> None:
        _show(console, rec)

    if not once:
        console.print(f"watching {', '.join(settings.models) or 'every registered model'} in "
                      f"{settings.tracking_uri} every {interval:g} s; Ctrl-C stops")
    done = watch(settings, once=once, interval_s=interval, on_verdict=show)
    if once and any(r["verdict"] == "FAIL" for r in done):
        raise typer.Exit(1)


def _show(console, rec: dict) -> None:
    """A verdict in lines that fit the terminal: the verdict, what it was gated against, then
    one line per failed check (the whole table is the verdict run's verdict/comparison.txt)."""
    color = "green" if rec["verdict"] == "PASS" else "red"
    console.print(Text.assemble(f"models:/{rec['model']}/{rec['version']}: ", (rec["verdict"], color),
                                f" ({rec['seconds']:.0f} s, MLflow run {rec['run_id']})"))
    console.print(Text(f"  vs {rec['reference']}"))
    lines = rec.get("failures") or ([] if rec["verdict"] == "PASS" else [rec["reason"]])
    for line in lines[:MAX_LINES]:
        console.print(Text(f"  - {line}"))  # wrapped at the terminal's width by rich
    if len(lines) > MAX_LINES:
        console.print(Text(f"  ... {len(lines) - MAX_LINES} more in the run's verdict/comparison.txt"))


MAX_LINES = 12  # failed checks shown per verdict; the rest are in its MLflow run


def _regate(tracking_uri: str, uris: list[str], console) -> list[str]:
    """Make each named version pending again (its verdict tag removed), so this watch gates it;
    the registered models named."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from mlflow.tracking import MlflowClient

    from moeflow.errors import UserError
    from moeflow.evaluation import verdict as V

    client = MlflowClient(tracking_uri=tracking_uri)
    for uri in uris:
        parsed = V.parse_uri(uri)
        if parsed is None:
            raise UserError(f"--regate {uri!r}: expected models:/NAME/VERSION or models:/NAME@ALIAS")
        version, verdict, _ = V.resolve_verdict(client, *parsed)
        V.clear_verdict(client, parsed[0], version)
        console.print(f"models:/{parsed[0]}/{version}: verdict {verdict or 'none'} cleared; gating it again")
    return [V.parse_uri(u)[0] for u in uris]  # type: ignore[index]  # each parsed above


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
