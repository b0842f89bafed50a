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

from pathlib import Path
from typing import Optional

import typer


def tune_serving(
    config: str = typer.Argument(..., help="pipeline config YAML (model.path, deploy:, serving:)"),
    out: Optional[Path] = typer.Option(None, help="output dir (default <workdir>/tune-serving-<time>)"),
    profile: Optional[str] = typer.Option(None, help="traffic profile YAML (default serving.profile)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. serving.budget_s=120"),
    address: Optional[str] = typer.Option(None, help="Ray cluster address (default $RAY_ADDRESS, else local)"),
):
    """Pick the deploy: knobs with the best goodput on a traffic profile (writes serving.yaml)."""
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: the stage loads Ray Serve, MLflow and torch; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import serving as action

    action.tune_serving(**options)


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
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: the load generator; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import serving as action

    ctx_args = list(options.pop("ctx").args)
    action.bench_serve(ctx_args, **options)


def register(app: typer.Typer) -> None:
    app.command("tune-serving")(tune_serving)
    bench = typer.Typer(no_args_is_help=True, help="benchmarks (vllm bench's names)")
    bench.command("serve", context_settings={"allow_extra_args": True})(bench_serve)
    app.add_typer(bench, name="bench")
