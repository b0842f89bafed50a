"""`moeflow regress`: evaluate a model (+ adapter) or an endpoint on a suite; record
or compare baselines in MLflow.

    moeflow regress --model demo-work/model --record-baseline golden-v1
    moeflow regress --model demo-work/model --adapter ADAPTER_DIR --baseline golden-v1
    moeflow regress --endpoint http://127.0.0.1:8000 --served-model demo --baseline golden-v1

The candidate is compared with the baseline sample by sample (paired deltas)
and, by default, must reproduce its recorded outputs (greedy tokens, per-token
log-probs): `--agreement report` for a meant change (task metrics still gate).

Exit codes: 0 passed / recorded, 1 a metric regressed, 2 bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from moeflow.errors import UserError
from workflows.printer import error_line, make_console


def _evaluate(suite, model, adapter, endpoint, served_model, shards, dtype, batch_size, seed,
              tokenizer=None):
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.evaluation.endpoint import evaluate_endpoint
    from moeflow.evaluation.runners import evaluate

    if endpoint:
        if model or adapter:
            raise UserError("--endpoint evaluates the served model; drop --model/--adapter")
        if not served_model:
            raise UserError("--endpoint needs --served-model NAME (the base or adapter name)")
        return evaluate_endpoint(suite, endpoint, served_model, tokenizer=tokenizer)
    if not model:
        raise UserError("name the model to evaluate: --model DIR (or --endpoint URL)")
    if not Path(model, "config.json").is_file():
        raise UserError(f"--model {model}: not a Hugging Face checkpoint dir (no config.json)")
    kwargs = dict(shards=shards, dtype=dtype, batch_size=batch_size, seed=seed)
    if shards <= 1:
        return evaluate(suite, model, [adapter], **kwargs)[0]
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from workflows.raylocal import ray_session

    with ray_session(None):
        return evaluate(suite, model, [adapter], **kwargs)[0]


def _track(result: dict, extra: dict, *, uri: str, experiment: str, baseline: str | None,
           record: str | None, passed: bool, console: Console) -> None:
    """Log the evaluation to MLflow: as baseline `record`, or as a plain eval run."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.evaluation import baseline as B

    tags = {"moeflow.eval": "regress", "moeflow.passed": str(passed).lower()}
    if baseline:
        tags["moeflow.compared_to"] = baseline
    if record:
        run = B.record_baseline(record, result, tracking_uri=uri, experiment=experiment,
                                tags=tags, extra=extra)
        console.print(f"recorded baseline {record!r}: MLflow run {run} in {uri}")
    else:
        run = B.log_result(result, tracking_uri=uri, experiment=experiment, tags=tags,
                           extra=extra, run_name=f"regress-{baseline or 'eval'}")
        console.print(f"results: MLflow run {run} in {uri}")


def regress(
    model: Optional[str] = typer.Option(None, help="base checkpoint dir (HF layout)"),
    adapter: Optional[str] = typer.Option(None, help="PEFT adapter dir applied to --model"),
    endpoint: Optional[str] = typer.Option(None, help="OpenAI-compatible server URL instead of --model"),
    served_model: Optional[str] = typer.Option(None, help="model name to request from --endpoint"),
    tokenizer: Optional[str] = typer.Option(None, help="with --endpoint: local HF tokenizer dir for lm-eval tasks"),
    suite: Optional[str] = typer.Option(None, help="suite YAML (default: the shipped golden suite)"),
    baseline: Optional[str] = typer.Option(None, help="compare against this recorded baseline"),
    record_baseline: Optional[str] = typer.Option(None, "--record-baseline",
                                                  help="record the results as baseline NAME"),
    tracking_uri: Optional[str] = typer.Option(None,
                                               help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else mlruns/)"),
    experiment: str = typer.Option("moeflow", help="MLflow experiment for the runs"),
    shards: int = typer.Option(1, min=1, help="Ray tasks to shard the eval set over (1: in-process)"),
    dtype: str = typer.Option("float32", help="compute dtype"),
    batch_size: int = typer.Option(16, min=1, help="requests per forward pass"),
    seed: int = typer.Option(0, help="torch seed"),
    agreement: str = typer.Option("gate", help="output agreement with --baseline's recorded outputs: "
                                  "gate (an unchanged model must reproduce them), report, off"),
    max_kl: float = typer.Option(1e-3, min=0, help="largest mean per-token KL vs the baseline (nats)"),
    min_token_agreement: float = typer.Option(0.95, min=0, max=1,
                                              help="smallest share of greedy / top-1 tokens equal to the baseline's"),
    tie_margin: float = typer.Option(0.05, min=0, help="a flip whose log-odds swing is at most "
                                     "this (nats) is a near tie, not a change"),
):
    """Evaluate on a fixed suite; record a baseline or fail on regression against one."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.evaluation import baseline as B
    from moeflow.evaluation.report import diff_table, failure_summary, metrics_table
    from moeflow.evaluation.suite import load_suite
    from moeflow.tracking import resolve_tracking_uri

    console = make_console()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype {dtype!r}: use float32, bfloat16 or float16")
    if agreement not in ("gate", "report", "off"):
        raise UserError(f"--agreement {agreement!r}: use gate, report or off")
    rule = None if agreement == "off" else B.Agreement(agreement, max_kl, min_token_agreement, tie_margin)
    loaded = load_suite(suite)
    uri = resolve_tracking_uri(tracking_uri)
    reference = B.load_baseline(baseline, tracking_uri=uri) if baseline else None
    result = _evaluate(loaded, model, adapter, endpoint, served_model, shards, dtype,
                       batch_size, seed, tokenizer)
    console.print(metrics_table(result, f"suite {loaded.name} ({loaded.sha256[:12]})"))
    extra = {"manifest_sha256": B.model_fingerprint(model) if model else None,
             "adapter_sha256": B.dir_checksum(adapter) if adapter else None, "seed": seed,
             "config": {"model": model, "adapter": adapter, "endpoint": endpoint,
                        "served_model": served_model, "suite": str(loaded.path)}}
    rows = []
    if reference:
        run_id, ref = reference
        rows = B.compare(ref, result, label=f"baseline {baseline!r}", agreement=rule)
        console.print(diff_table(rows, f"candidate vs baseline {baseline!r} (run {run_id})"))
    passed = not any(r.failed for r in rows)
    _track(result, extra, uri=uri, experiment=experiment, baseline=baseline,
           record=record_baseline if passed else None, passed=passed, console=console)
    if not passed:
        make_console(stderr=True).print(error_line(failure_summary(rows, f"baseline {baseline!r}"),
                                                   "regression:"), soft_wrap=True)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `moeflow regress` to the CLI."""
    app.command(name="regress")(regress)
