"""Stage `deploy`: serve the converted base + fine-tuned adapter on Ray Serve.

    moeflow run CONFIG                # as the last DAG stage
    moeflow deploy --run RUN_ID       # from a finished pipeline run
    moeflow serve CONFIG              # foreground, local

What the stage does: deploys the Ray Serve application `moeflow` (OpenAI API:
base + adapters in shared mode, or the adapter merged with `deploy.merge`),
smoke-tests every served model over HTTP, and records the URL, the models and
the smoke results. The application lives as long as the Ray cluster it was
deployed to: on a real cluster (RAY_ADDRESS) it keeps serving after the
pipeline ends; with the runner's in-process local Ray it stops when the
pipeline's Ray shuts down — use `moeflow serve` / `moeflow deploy --run` to
keep a local endpoint in the foreground.

What is served (checkpoint, adapters, merged or not, serving.yaml) is decided once, in
moeflow.serving.deployment.decide, which `moeflow deploy` uses too.
"""

from __future__ import annotations

from pathlib import Path

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.serving import vllm_backend, vllm_run
from moeflow.serving.deployment import Deployment, apply_serving, decide
from moeflow.serving.launch import apply_plan, deploy, settings_for
from tasks.base import StageContext, StageSpec


def _refuse_failed_regress(ctx: StageContext) -> None:
    regress = ctx.inputs.get("regress")
    if regress is not None and regress.get("passed") is False:
        raise UserError("deploy: the regress stage did not pass; refusing to deploy")


def run(ctx: StageContext) -> dict:
    """Deploy the pipeline's converted model and fine-tuned adapter; smoke-test it."""
    import ray  # seconds to import: only when the stage runs

    _refuse_failed_regress(ctx)
    dep = decide(ctx.config, ctx.inputs)  # deploy.backend auto: the plan stage's choice
    if dep.backend == "local" and not ray.is_initialized():
        raise UserError("the deploy stage needs a Ray runtime (run it through `moeflow run` or "
                        "`moeflow deploy`)")
    # serving.yaml: the user's deploy.serving_config, else the serving stage's (explicit deploy: wins)
    cfg, sources = apply_serving(ctx.config, dep.serving_yaml)
    plan = ctx.inputs.get("plan", {}).get("plan", {}).get("serving")
    if dep.backend == "vllm":  # a Ray Serve LLM app (moeflow/serving/vllm_backend.py)
        return _run_vllm(ctx, cfg, dep, plan)
    return _run_local(ctx, cfg, dep, plan, sources)


def _run_local(ctx: StageContext, cfg: PipelineConfig, dep: Deployment, plan: dict | None,
               sources: dict[str, str]) -> dict:
    """moeflow's engine on Ray Serve: start, smoke-test, record."""
    import mlflow  # seconds to import: only when the stage runs

    from moeflow.serving.app import api_key_from_env  # imports the engine (torch)

    cfg = apply_plan(cfg, plan)
    settings = settings_for(cfg, dep, api_key_from_env(cfg.deploy.api_key_env), stored=ctx.stored)
    record = deploy(cfg, settings, notify=ctx.note)
    record["replicas"] = {"num_replicas": cfg.deploy.num_replicas, "num_cpus": cfg.deploy.num_cpus,
                          "from": "serving.yaml" if sources.get("num_replicas") == "serving.yaml"
                          else "config" if ctx.config.deploy.num_replicas else "plan"}
    if max((plan or {}).get(k) or 1 for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel")) > 1:
        record["plan_not_applied"] = ("the plan serves with TP/PP/EP > 1; the local backend holds a whole "
                                      "model per replica: deploy.backend vllm applies them")
    tuned = dep.serving_yaml
    record["serving_yaml"] = {"path": str(tuned) if tuned else None, "knobs": sources}
    record["served"] = ", ".join(record["models"])  # one line in the run summary
    # the operators stage's, else transformers' default
    record["experts_implementation"] = dep.experts_implementation or "grouped_mm"
    ctx.write_json("deployment.json", record)
    if mlflow.active_run():
        _log_smoke(record)
        _log_serving(tuned, sources, cfg)
        mlflow.log_param("experts_implementation", record["experts_implementation"])
        mlflow.log_param("ingress", record["ingress"])
    return record


def _run_vllm(ctx: StageContext, cfg: PipelineConfig, dep: Deployment, plan: dict | None) -> dict:
    """deploy.backend vllm: write serve_config.yaml, then (unless deploy.dry_run) run it on the
    pipeline's Ray."""
    import mlflow  # seconds to import: only when the stage runs

    # workdir in a store: replicas load the base and merged checkpoints from it, the ones this
    # stage merges from where its output is published (uploaded before the app starts)
    stored = {**ctx.stored, str(ctx.out_dir): ctx.store_dir} if ctx.store_dir else dict(ctx.stored)
    # the written config is for GPU clusters; a deployment here runs on what the Ray cluster has
    device = "gpu" if cfg.deploy.dry_run else vllm_run.cluster_device()
    built = vllm_backend.build_run(cfg, dep, plan, Path(ctx.out_dir), stored=stored, device=device)
    path = vllm_backend.write_config(built["serve_config"], Path(ctx.out_dir) / "serve_config.yaml")
    record = {"backend": "vllm", "serve_config": str(path), "checkpoint": dep.checkpoint,
              "plan": built["plan"], "adapters": built["adapters"], "uploads": built["uploads"],
              "notes": built["notes"], "deployed": False, "served": ", ".join(
                  c["model_loading_config"]["model_id"] for c in built["llm_configs"])}
    if not cfg.deploy.dry_run:
        if ctx.store_dir:
            vllm_backend.upload_merged(built, Path(ctx.out_dir), ctx.store_dir)
        record.update(vllm_backend.serve_and_smoke(cfg, built, device, notify=ctx.note), deployed=True)
    ctx.write_json("deployment.json", record)
    if mlflow.active_run():
        mlflow.log_artifact(str(path))
        mlflow.log_param("deploy_backend", "vllm")
        if record["deployed"]:
            mlflow.log_param("vllm_device", device)
            _log_smoke(record)
    return record


def _log_smoke(record: dict) -> None:
    """MLflow: the endpoint's URL, the smoke completions and their latencies."""
    import mlflow  # seconds to import: only when the stage runs

    mlflow.log_dict(record["smoke"], "smoke.json")
    mlflow.set_tag("moeflow.deploy.url", record["url"])
    for name, res in record["smoke"]["completions"].items():
        mlflow.log_metric(f"smoke_latency_s.{name}", res["latency_s"])


def _log_serving(path: str | None, sources: dict[str, str], cfg: PipelineConfig) -> None:
    """MLflow params: which knobs came from serving.yaml, which the config overrode, the values used."""
    import mlflow  # seconds to import: only when the stage runs

    if not path:
        return
    mlflow.log_params({"serving_yaml": str(path),
                       "knobs_from_serving_yaml": ",".join(k for k, s in sources.items() if s == "serving.yaml") or "-",
                       "knobs_kept_from_config": ",".join(k for k, s in sources.items() if s != "serving.yaml") or "-",
                       **{f"applied.{k}": getattr(cfg.deploy, k) for k in sources}})


STAGE = StageSpec(
    name="deploy", run=run, upstream=("convert", "plan", "finetune", "regress"),
    after=("operators", "calibrate", "serving"),
    sections=("model", "deploy", "lora"), num_cpus=0.5,
    cacheable=False,  # the result is a live endpoint: a cached record would point at nothing
    description="Ray Serve OpenAI endpoint: shared base + LoRA adapters (or merged), smoke-tested",
)
