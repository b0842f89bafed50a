"""What `moeflow tune-serving` and `moeflow bench serve` do (workflows/commands/serving.py declares
what they take): the serving stage's search on a checkpoint outside a pipeline, and a
`vllm bench serve`-style load test of an endpoint."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import mlflow

from moeflow.core.config import load_config
from moeflow.core.errors import UserError
from moeflow.core.tracking import resolve_tracking_uri
from moeflow.serving.app import api_key_from_env
from moeflow.serving.loadgen import format_result, parse_goodput, random_requests, replay, summarize
from moeflow.serving.traffic import generate, load_profile
from tasks.base import StageContext
from tasks.serving import STAGE, run
from workflows.printer import make_console
from workflows.raylocal import ray_session


def tune_serving(config: str, out: Path | None, profile: str | None, set_: list[str], address: str | None) -> None:
    """The serving stage's search on model.path as it is (no pipeline upstream): serving.yaml + report."""
    cfg = load_config(config, set_ + ([f"serving.profile={profile}"] if profile else []))
    if not Path(cfg.model.path, "config.json").is_file():
        raise UserError(f"model.path {cfg.model.path}: not a Hugging Face checkpoint dir (no config.json)")
    assert STAGE.preflight is not None  # the serving stage has one
    STAGE.preflight(cfg)  # a malformed profile fails here, before Ray starts
    out = out or Path(cfg.workdir) / f"tune-serving-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    uri = resolve_tracking_uri(cfg.tracking.uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(cfg.experiment)
    inputs = {"convert": {"output_dir": str(Path(cfg.model.path).resolve())}, "finetune": {}}
    with ray_session(cfg, address), mlflow.start_run(run_name="tune-serving") as active:
        mlflow.set_tag("moeflow.stage", "serving")
        ctx = StageContext(stage="serving", config=cfg, inputs=inputs, out_dir=out,
                           mlflow_run_id=active.info.run_id, tracking_uri=uri)
        record = run(ctx)
    console = make_console()
    console.print(f"serving.yaml: {record['serving_yaml']}   report: {record['report_path']}")
    console.print(f"MLflow: {uri}  run {active.info.run_id}")


def bench_serve(ctx_args: list[str], url: str, model: str, lora_modules: list[str], request_rate: float,
                burstiness: float, max_concurrency: int | None, num_prompts: int, random_input_len: int,
                random_output_len: int, random_range_ratio: float, goodput: list[str], metric_percentiles: str,
                traffic_profile: str | None, vocab_size: int, seed: int, api_key: str | None, save_result: bool,
                result_filename: Path | None) -> None:
    """Replay random or profiled requests against `url`; print vLLM's metric names."""
    # vllm's `--goodput ttft:MS tpot:MS` and `--lora-modules a b` take several values after one
    # flag; click keeps only the first, the others arrive as extra arguments
    slos = [a for a in ctx_args if a.split(":")[0] in ("ttft", "tpot", "e2el")]
    extra = [a for a in ctx_args if a not in slos]
    if extra and not lora_modules:
        raise UserError(f"unexpected argument {extra[0]!r}")
    lora_modules = [*lora_modules, *extra]
    try:
        slo = parse_goodput([g for item in [*goodput, *slos] for g in item.split()])
        pcts = tuple(float(p) for p in metric_percentiles.split(","))
    except ValueError as exc:
        raise UserError(str(exc).replace("could not convert string to float", "--metric-percentiles")) from None
    models = list(lora_modules) or [model]
    if traffic_profile:
        prof = load_profile(traffic_profile)
        reqs = generate(prof, models=[model, *lora_modules], base=model, vocab=vocab_size,
                        rate=None if request_rate == float("inf") else request_rate,
                        num_requests=num_prompts, seed=seed)
        slo = slo or prof.slo.limits()
    else:
        reqs = random_requests(num_prompts, models, input_len=random_input_len, output_len=random_output_len,
                               range_ratio=random_range_ratio, vocab=vocab_size, rate=request_rate,
                               burstiness=burstiness, seed=seed)
    results, wall = asyncio.run(replay(url.rstrip("/"), reqs, max_concurrency=max_concurrency,
                                       api_key=api_key or api_key_from_env()))
    metrics = summarize(results, wall, goodput=slo or None, percentiles=pcts, max_concurrency=max_concurrency)
    print(format_result(metrics, pcts))
    if metrics["completed"] == 0:
        raise UserError(f"no request succeeded against {url}: {'; '.join(metrics.get('errors', []))}")
    if save_result or result_filename:
        qps = "inf" if request_rate == float("inf") else f"{request_rate:g}"
        path = result_filename or Path(f"moeflow-bench-{qps}qps.json")
        path.write_text(json.dumps(dict(metrics, request_rate=request_rate, burstiness=burstiness,
                                        model_id=model), indent=2))
