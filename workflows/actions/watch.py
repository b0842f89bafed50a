"""What `moeflow watch` does (workflows/commands/watch.py declares what it takes): gate new
registered versions here, or submit the watcher as a Ray Job."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import typer
from mlflow.tracking import MlflowClient
from rich.text import Text

from moeflow.core.errors import UserError
from moeflow.core.tracking import resolve_tracking_uri
from moeflow.evaluation import verdict as V
from moeflow.ops.watch import WatchSettings
from moeflow.ops.watch import watch as watch_versions
from workflows.printer import make_console
from workflows.submit import job_env, running_jobs, submit_job


def watch(model: list[str] | None, once: bool, interval: float, suite: str | None, webhook: str | None,
          experiment: str, tracking_uri: str | None, dtype: str, address: str | None,
          regate: list[str] | None, runtime_env: Path) -> None:
    """Gate pending versions (once, or polling), print each verdict; exit 1 on a FAIL with --once."""
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

    def printed(rec: dict) -> None:
        show(console, rec)

    if not once:
        console.print(f"watching {', '.join(settings.models) or 'every registered model'} in "
                      f"{settings.tracking_uri} every {interval:g} s; Ctrl-C stops")
    done = watch_versions(settings, once=once, interval_s=interval, on_verdict=printed)
    if once and any(r["verdict"] == "FAIL" for r in done):
        raise typer.Exit(1)


def show(console, rec: dict) -> None:
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
    running = running_jobs(address, "moeflow.watch", experiment)
    if running:
        raise UserError(f"a watcher of experiment {experiment!r} already runs on {address}: job "
                        f"{running[0]} (stop it first: ray job stop {running[0]} --address {address})")
    entrypoint = "python -m workflows.cli watch " + " ".join(shlex.quote(a) for a in args)
    _, job_id = submit_job(address, entrypoint, job_env(runtime_env),
                           f"moeflow-watch-{experiment}-{int(time.time())}", {"moeflow.watch": experiment})
    console.print(f"submitted watcher job {job_id} to {address}; logs: ray job logs -f {job_id} "
                  f"--address {address}")


