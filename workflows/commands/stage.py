"""One way to run a stage from the command line.

`moeflow operators CONFIG` (likewise `calibrate`, `finetune`) is `moeflow run CONFIG` with that
stage as its target: the same runner, cache, MLflow records, stage table, exit codes and resume
hint as `run` -- this module is what both print through. A stage command adds only the lines
that show its stage's result (`stage_command(stage, show=...)`).

Commands that take files rather than a pipeline config (`convert SRC OUT`, `plan MODEL`,
`compare A B`, `eplb LOAD`, `regress --model`) are tools over the library, not stage runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from moeflow.core.errors import UserError
from workflows.printer import console, styled

if TYPE_CHECKING:
    from moeflow.core.config import PipelineConfig

SetOpt = typer.Option(None, "--set", help="Override a config key: --set lora.rank=8 (repeatable)")
AddressOpt = typer.Option(None, help="Ray address (default $RAY_ADDRESS, else local)")


def load(config: str, overrides: list[str] | None) -> PipelineConfig:
    """CONFIG is a YAML path, or env:VAR holding YAML text (used by `submit`)."""
    # lazy: pydantic's sections and PyYAML; `moeflow --help` loads none of what commands run
    from moeflow.core.config import apply_overrides, load_config, validate

    if config.startswith("env:"):
        text = os.environ.get(config[4:])
        if text is None:
            raise UserError(f"environment variable {config[4:]} is not set")
        # lazy: as above
        import yaml

        raw = apply_overrides(yaml.safe_load(text) or {}, list(overrides or []))
        return validate(raw, source=config)
    return load_config(config, overrides or [])


def finish(outcome) -> None:
    """The stage table, the MLflow line, and for a run that did not finish the resume hint and
    its exit code (1 a stage failed; 130 / 143 stopped)."""
    # lazy: the report reads MLflow's types; `moeflow --help` loads none of what commands run
    from workflows import report

    console.print(report.stage_table(outcome.stages, title=f"pipeline run {outcome.run_id}"))
    console.print(f"MLflow: {outcome.tracking_uri}  parent run {outcome.run_id}: ",
                  styled(outcome.status, "bold"), sep="", soft_wrap=True)
    if outcome.status != "FINISHED":
        console.print(f"fix the cause, then resume with:\n  moeflow resume {outcome.run_id}"
                      + ("" if not os.environ.get("MLFLOW_TRACKING_URI")
                         else "   (same MLFLOW_TRACKING_URI)"))
        raise typer.Exit(getattr(outcome, "exit_code", None) or (130 if outcome.status == "KILLED" else 1))


def run_stage(config: str, stage: str, overrides: list[str] | None, no_cache: bool,
              address: str | None = None) -> dict:
    """Run `stage` (and what it needs, cached where possible) through the pipeline runner, print
    as `moeflow run` does, and return the stage's result record."""
    # lazy: the runner brings Ray and MLflow; `moeflow --help` loads none of what commands run
    from workflows import report
    from workflows.runner import run_pipeline

    cfg = load(config, overrides)
    outcome = run_pipeline(cfg, address=address, targets=[stage], rerun=(stage,) if no_cache else (),
                           on_event=report.event_printer(console))
    finish(outcome)
    state = outcome.stages.get(stage)
    if state is None or not state.result:
        console.print(f"{stage} has no result in run {outcome.run_id}: is it enabled in {config}?",
                      soft_wrap=True)
        raise typer.Exit(1)
    return state.result


def stage_command(stage: str, show: Callable[[Console, dict], None], help_: str,
                  example: str) -> Callable[..., None]:
    """The typer command `moeflow <stage> CONFIG`: `run_stage`, then `show(console, result)`."""

    def command(config: str = typer.Argument(..., help="pipeline YAML (see configs/)"),
                set_: Optional[list[str]] = typer.Option(
                    None, "--set", help=f"override a config key, e.g. --set {example}"),
                no_cache: bool = typer.Option(False, "--no-cache",
                                              help=f"rerun {stage} even if a cached result exists"),
                address: Optional[str] = AddressOpt) -> None:
        show(console, run_stage(config, stage, set_, no_cache, address))

    command.__doc__ = help_
    command.__name__ = stage
    return command

