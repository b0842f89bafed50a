"""What `moeflow regress` does (workflows/commands/regress.py declares what it takes): evaluate a
model (+ adapter) or an endpoint on a suite, compare with a recorded baseline, track in MLflow."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from moeflow.core.errors import UserError
from moeflow.core.tracking import resolve_tracking_uri
from moeflow.evaluation import baseline as B
from moeflow.evaluation.endpoint import evaluate_endpoint
from moeflow.evaluation.report import diff_table, failure_summary, metrics_table
from moeflow.evaluation.runners import evaluate
from moeflow.evaluation.suite import load_suite
from workflows.printer import error_line, make_console
from workflows.raylocal import ray_session


def _evaluate(suite, model, adapter, endpoint, served_model, shards, dtype, batch_size, seed,
              tokenizer=None):
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
    with ray_session(None):
        return evaluate(suite, model, [adapter], **kwargs)[0]


def _track(result: dict, extra: dict, *, uri: str, experiment: str, baseline: str | None,
           record: str | None, passed: bool, console: Console) -> None:
    """Log the evaluation to MLflow: as baseline `record`, or as a plain eval run."""
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


def run(*, model: str | None, adapter: str | None, endpoint: str | None, served_model: str | None,
        tokenizer: str | None, suite: str | None, baseline: str | None, record_baseline: str | None,
        tracking_uri: str | None, experiment: str, shards: int, dtype: str, batch_size: int, seed: int,
        agreement: str, max_kl: float, min_token_agreement: float, tie_margin: float) -> None:
    """Evaluate on a fixed suite; record a baseline or fail on regression against one."""
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


