"""`moeflow tune-serving` and `moeflow bench serve`: the serving search and its load generator.

    moeflow tune-serving configs/demo.yaml --out work/serving     # model.path + deploy.adapters
    moeflow bench serve --url http://127.0.0.1:8000 --model demo --request-rate 8 \\
        --num-prompts 200 --random-input-len 64 --random-output-len 32 --goodput ttft:500 tpot:50

`tune-serving` runs the serving stage's search on the config's model.path and
deploy.adapters (the pipeline runs it on its converted model and fine-tuned
adapters), logs it to MLflow and writes serving.yaml under --out; set
deploy.serving_config to that file and `moeflow serve`/`deploy` use it.
`bench serve` takes `vllm bench serve`'s flags and prints its metric names.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Optional

import typer

from moeflow.errors import UserError
from workflows.printer import make_console


def tune_serving(
    config: str = typer.Argument(..., help="pipeline config YAML (model.path, deploy:, serving:)"),
    out: Optional[Path] = typer.Option(None, help="output dir (default <workdir>/tune-serving-<time>)"),
    profile: Optional[str] = typer.Option(None, help="traffic profile YAML (default serving.profile)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. serving.budget_s=120"),
    address: Optional[str] = typer.Option(None, help="Ray cluster address (default $RAY_ADDRESS, else local)"),
):
    """Pick the deploy: knobs with the best goodput on a traffic profile (writes serving.yaml)."""

    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    import mlflow

    from moeflow.config import load_config
    from moeflow.tracking import resolve_tracking_uri
    from tasks.base import StageContext
    from tasks.serving import STAGE, run
    from workflows.raylocal import ray_session

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


def bench_serve(
    ctx: typer.Context,
    url: str = typer.Option(..., "--url", help="server base URL (http://host:port)"),
    model: str = typer.Option(..., "--model", help="served model name sent in requests"),
    lora_modules: list[str] = typer.Option([], "--lora-modules",
                                           help="adapter names; each request picks one at random"),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="requests/s (inf: all at once)"),
    burstiness: float = typer.Option(1.0, "--burstiness", help="gamma shape of arrivals: 1 Poisson, < 1 burstier"),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="at most this many in flight"),
    num_prompts: int = typer.Option(100, "--num-prompts", min=1),
    random_input_len: int = typer.Option(32, "--random-input-len", min=1),
    random_output_len: int = typer.Option(32, "--random-output-len", min=1),
    random_range_ratio: float = typer.Option(0.0, "--random-range-ratio", min=0.0, max=0.99),
    goodput: list[str] = typer.Option([], "--goodput", help="SLOs: ttft:MS tpot:MS e2el:MS"),
    metric_percentiles: str = typer.Option("99", "--metric-percentiles", help="comma-separated, e.g. 50,90,99"),
    traffic_profile: Optional[str] = typer.Option(None, "--traffic-profile",
                                                  help="a moeflow traffic profile instead of random"),
    vocab_size: int = typer.Option(500, "--vocab-size", help="random prompt token ids are drawn below this"),
    seed: int = typer.Option(0, "--seed"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="bearer token (default $MOEFLOW_API_KEY)"),
    save_result: bool = typer.Option(False, "--save-result", help="write the metrics as JSON"),
    result_filename: Optional[Path] = typer.Option(None, "--result-filename"),
):
    """Benchmark an OpenAI-compatible endpoint like `vllm bench serve` (same flags, same metric names)."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.serving.app import api_key_from_env
    from moeflow.serving.loadgen import format_result, parse_goodput, random_requests, replay, summarize

    # vllm's `--goodput ttft:MS tpot:MS` and `--lora-modules a b` take several values after one
    # flag; click keeps only the first, the others arrive as extra arguments
    slos = [a for a in ctx.args if a.split(":")[0] in ("ttft", "tpot", "e2el")]
    extra = [a for a in ctx.args if a not in slos]
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
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from moeflow.serving.traffic import generate, load_profile

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


def register(app: typer.Typer) -> None:
    app.command("tune-serving")(tune_serving)
    bench = typer.Typer(no_args_is_help=True, help="benchmarks (vllm bench's names)")
    bench.command("serve", context_settings={"allow_extra_args": True})(bench_serve)
    app.add_typer(bench, name="bench")
