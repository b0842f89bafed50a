"""The `moeflow` command line.

    moeflow demo                                  # tiny model + data, whole pipeline
    moeflow run configs/demo.yaml --set lora.rank=8
    moeflow resume RUN_ID                         # after fixing what failed
    moeflow status RUN_ID [--json]
    moeflow runs
    moeflow submit configs/demo.yaml --address http://HEAD:8265 --follow
    moeflow ui

Exit codes: 0 ok, 1 a stage failed, 2 bad input (one-line message), 130 Ctrl-C (SIGINT),
143 SIGTERM -- whichever command it stops (`run`, `serve`, `deploy`), during start-up or
after; a stopped server first lets requests in flight finish (moeflow.serving.app.DRAIN_S).
`-v` / `--verbose` anywhere on the line shows library and Ray worker output
(workflows/verbosity.py); by default the terminal has moeflow's own lines.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from moeflow.core.errors import UserError
from workflows.commands.stage import AddressOpt, SetOpt, finish, load
from workflows.printer import console, err_console, error_line


class _Deferred:
    """A module imported on first use: `moeflow --help` must not pay for MLflow (seconds)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


report = _Deferred("workflows.report")
T = _Deferred("moeflow.core.tracking")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Adapt, LoRA-fine-tune and serve MoE models on Ray, tracked in MLflow.")
REPO = Path(__file__).resolve().parent.parent
UI_MODE = "#/?workflowType=machine_learning"  # the UI's "Model training" mode, not GenAI



@app.command()
def run(config: str = typer.Argument(..., help="pipeline YAML (see configs/)"),
        set_: Optional[list[str]] = SetOpt,
        address: Optional[str] = AddressOpt,
        from_: Optional[list[str]] = typer.Option(None, "--from",
                                                  help="rerun STAGE and all downstream; upstream must be cached"),
        only: Optional[list[str]] = typer.Option(None, "--only", help="run just STAGE; upstream must be cached"),
        rerun: Optional[list[str]] = typer.Option(None, "--rerun", help="run STAGE even if cached"),
        no_cache: bool = typer.Option(False, "--no-cache", help="execute every stage"),
        stages: Optional[list[str]] = typer.Option(None, "--stages", help="run just these stages "
                                                   "(comma list or repeated) and those they need"),
        dry_run: bool = typer.Option(False, "--dry-run", help="price every stage (time, memory, "
                                     "bytes, cost) and check space, SLOs and data; runs nothing"),
        json_: bool = typer.Option(False, "--json", help="with --dry-run: machine-readable")):
    """Run the pipeline DAG on Ray, tracked in MLflow."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from workflows.runner import run_pipeline
    from workflows.selection import enable_only

    cfg = load(config, set_)
    if stages:
        cfg = enable_only(cfg, [n.strip() for s in stages for n in s.split(",") if n.strip()])
    if dry_run or json_:
        if not dry_run:
            raise UserError("--json goes with --dry-run")
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from workflows.dryrun import main as dry_main

        raise typer.Exit(dry_main(cfg, console, json_))
    outcome = run_pipeline(cfg, address=address, from_=from_ or (), only=only or (),
                           rerun=rerun or (), use_cache=not no_cache, on_event=report.event_printer(console))
    finish(outcome)


@app.command()
def resume(run_id: str = typer.Argument(..., help="pipeline (parent) run id"),
           set_: Optional[list[str]] = SetOpt,
           config: Optional[str] = typer.Option(None, help="use this YAML instead of the run's config"),
           rerun: Optional[list[str]] = typer.Option(None, "--rerun", help="run STAGE even if done"),
           address: Optional[str] = typer.Option(None, help="Ray address"),
           tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI")):
    """Continue a pipeline run: done stages are reused, the rest run."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.core.config import apply_overrides, load_config, validate
    from workflows.runner import run_pipeline

    if config:
        extra = [f"tracking.uri={tracking_uri}"] if tracking_uri else []
        cfg = load_config(config, [*(set_ or []), *extra])
    else:
        client = T.client_for(T.existing_tracking_uri(tracking_uri))
        if T.get_pipeline_run(client, run_id).info.status == "FINISHED" and not set_ and not rerun:
            # every stage done: a resume would only run the uncacheable ones (deploy) again
            console.print(f"run {run_id} finished: nothing to resume (`--rerun STAGE` runs a stage again; "
                          f"`moeflow deploy --run {run_id}` serves it)", soft_wrap=True)
            return
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        import yaml

        raw = yaml.safe_load(T.download_text(client, run_id, "config.yaml")) or {}
        if tracking_uri:
            raw.setdefault("tracking", {})["uri"] = tracking_uri
        cfg = validate(apply_overrides(raw, set_ or []), source=f"run {run_id} config.yaml")
    outcome = run_pipeline(cfg, resume_run_id=run_id, rerun=rerun or (), address=address,
                           on_event=report.event_printer(console))
    finish(outcome)


@app.command()
def status(run_id: str, json_: bool = typer.Option(False, "--json", help="machine-readable"),
           tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI")):
    """State of each stage of a pipeline run."""
    client = T.client_for(T.existing_tracking_uri(tracking_uri))
    info = report.pipeline_status(client, run_id)
    if json_:
        print(json.dumps(info, indent=2))
    else:
        console.print(report.status_table(info))
        if info.get("hint"):
            console.print(info["hint"], soft_wrap=True)


@app.command()
def runs(experiment: Optional[str] = typer.Option(None, help="only this experiment"),
         limit: int = typer.Option(20, help="how many"),
         compare: Optional[list[str]] = typer.Option(
             None, "--compare", help="two pipeline run ids: --compare A B (side by side)"),
         json_: bool = typer.Option(False, "--json", help="with --compare: machine-readable"),
         tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI"),
         more: Optional[list[str]] = typer.Argument(None, hidden=True)):
    """Recent pipeline runs (stages in DAG order), or two compared: --compare A B."""
    client = T.client_for(T.existing_tracking_uri(tracking_uri))
    if compare:
        ids = [*compare, *(more or [])]
        if len(ids) != 2:
            raise UserError(f"--compare takes two pipeline run ids, got {len(ids)}")
        info = report.compare(client, *ids)
        if json_:
            print(json.dumps(info, indent=2))
            return
        for table in report.compare_tables(info):
            console.print(table)
        return
    console.print(report.runs_table(T.pipeline_runs(client, experiment, limit)))


@app.command()
def submit(config: str = typer.Argument(..., help="pipeline YAML"),
           address: str = typer.Option(..., help="Ray dashboard address, e.g. http://HEAD:8265"),
           set_: Optional[list[str]] = SetOpt,
           runtime_env: Path = typer.Option(REPO / "cluster" / "runtime_env.yaml", help="runtime_env YAML"),
           follow: bool = typer.Option(False, "--follow", help="stream the job's logs"),
           wait: bool = typer.Option(True, help="wait for the job to end")):
    """Submit the pipeline as a Ray Job to a cluster."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.core.config import apply_overrides, read_yaml, validate
    from workflows.submit import submit_pipeline

    raw = apply_overrides(read_yaml(config), set_ or [])
    validate(raw, source=config)  # fail here, not on the cluster
    status_ = submit_pipeline(raw, address=address, runtime_env_path=runtime_env,
                              follow=follow, wait=wait, console=console)
    if wait and status_ != "SUCCEEDED":
        raise typer.Exit(1)


@app.command()
def ui(port: int = typer.Option(5000, help="port"),
       host: str = typer.Option("127.0.0.1", help="bind address"),
       workers: int = typer.Option(1, help="server worker processes"),
       tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI")):
    """Open the MLflow UI on the tracking store (local sqlite store by default)."""
    uri = T.resolve_tracking_uri(tracking_uri)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
           "--host", host, "--port", str(port), "--workers", str(workers)]
    root = T.artifact_root_for(uri)
    if root:
        cmd += ["--default-artifact-root", root]
    # MLflow 3's UI opens in its GenAI mode unless told otherwise; moeflow's runs are training runs
    console.print(f"MLflow UI for {uri} at http://{host}:{port}/{UI_MODE}  (Ctrl-C stops it)")
    os.execv(sys.executable, cmd)


@app.command()
def demo(workdir: Path = typer.Option(Path("demo-work"), help="where the demo model and data go"),
         family: str = typer.Option("qwen3_moe", help="debug-model family"),
         set_: Optional[list[str]] = SetOpt,
         cache: bool = typer.Option(False, help="reuse cached stages from earlier demos"),
         serve: bool = typer.Option(False, "--serve", help="keep the deployed endpoint up until Ctrl-C")):
    """Build a tiny MoE + data set, run configs/demo.yaml end to end."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from workflows.demo import run_demo

    outcome = run_demo(workdir, family=family, overrides=set_ or [], use_cache=cache,
                       console=console, serve=serve)
    for line in report.results_lines(outcome.stages):
        console.print(line, soft_wrap=True)
    finish(outcome)
    console.print(f"open the MLflow UI with:  moeflow ui   (then http://127.0.0.1:5000/{UI_MODE})")
    if not serve:
        console.print(f"serve the result again with:  moeflow deploy --run {outcome.run_id}"
                      "   (or `moeflow demo --serve` to keep the demo's endpoint up)")


def main() -> None:
    """Console entry point: user errors are one line and exit 2, never a traceback."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from workflows.commands import register_all
    from workflows.verbosity import configure, take_flag

    args = take_flag(sys.argv[1:])
    configure()
    register_all(app)
    try:
        app(args=args, standalone_mode=True)
    except UserError as exc:
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from workflows.verbosity import verbose

        if verbose() and exc.__cause__ is not None:  # e.g. Ray's own failure behind the one line
            import traceback

            traceback.print_exception(exc.__cause__)
        err_console.print(error_line(exc), soft_wrap=True)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - MLflow refusing a store or URI is the user's input
        from moeflow.model.anatomy import config_refused, is_config_refusal

        if is_config_refusal(exc):  # a config.json value transformers refuses, wherever it was read
            err_console.print(error_line(config_refused(exc, "config.json")), soft_wrap=True)
            sys.exit(2)
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from mlflow.exceptions import MlflowException

        if not isinstance(exc, MlflowException):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        err_console.print(error_line(f"MLflow (tracking.uri): {first}"), soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt as exc:  # Ctrl-C 130; SIGTERM where a command turns it into this, 143
        from moeflow.core.errors import Terminated

        err_console.print("interrupted")
        sys.exit(143 if isinstance(exc, Terminated) else 130)


if __name__ == "__main__":
    main()
