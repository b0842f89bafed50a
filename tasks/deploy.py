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
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from moeflow.config import PipelineConfig
from moeflow.errors import UserError
from tasks.base import StageContext, StageSpec

ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
               "long_prefill_token_threshold", "max_long_partial_prefills", "max_model_len", "max_loras")


def engine_settings(cfg: PipelineConfig) -> dict:
    """Engine knobs from `deploy:`, overridden by the serving stage's serving.yaml if named."""
    d = cfg.deploy
    knobs = {k: getattr(d, k) for k in ENGINE_KEYS}
    if d.serving_config:
        path = Path(d.serving_config)
        if not path.is_file():
            raise UserError(f"deploy.serving_config: {path} does not exist")
        tuned = yaml.safe_load(path.read_text()) or {}
        tuned = tuned.get("engine", tuned) if isinstance(tuned, dict) else None
        if not isinstance(tuned, dict):
            raise UserError(f"{path}: expected a mapping of engine settings")
        unknown = sorted(set(tuned) - set(ENGINE_KEYS))
        if unknown:
            raise UserError(f"{path}: unknown engine setting {unknown[0]!r}; known: {', '.join(ENGINE_KEYS)}")
        knobs.update(tuned)
    return knobs


def tenant_adapters(finetune: dict | None) -> dict[str, str]:
    """{name: dir} of a finetune record's tenant adapters (finetune.adapters), main one excluded."""
    adapters = (finetune or {}).get("adapters") or {}
    return {name: a["adapter_dir"] for name, a in adapters.items() if a.get("tenant")}


def build_settings(cfg: PipelineConfig, base_dir: str, adapter: tuple[str, str] | None,
                   api_key: str | None, tenants: dict[str, str] | None = None):
    """ServeSettings from the config and the upstream records.

    Args:
        cfg: pipeline config (`deploy:` section).
        base_dir: converted checkpoint dir.
        adapter: (name, dir or models:/ URI) of the fine-tuned adapter, if any.
        api_key: bearer token required by the API (None: open).
        tenants: more fine-tuned adapters {name: dir} served beside it (shared mode).
    """
    from moeflow.serving.app import ServeSettings

    d = cfg.deploy
    adapters = dict(d.adapters)
    if adapter:
        adapters.setdefault(adapter[0], adapter[1])
    for name, path in (tenants or {}).items():
        adapters.setdefault(name, path)
    if d.merge and not adapter:
        raise UserError("deploy.merge: there is no fine-tuned adapter to merge")
    # default name: the original checkpoint's directory (what vLLM would call it), not "converted"
    name = d.served_model_name or Path(cfg.model.path).name or None
    return ServeSettings(base_dir=base_dir, served_model_name=name, adapters=adapters,
                         adapter_root=d.adapter_root, merge=adapter[0] if d.merge else None,
                         dtype=d.dtype, engine=engine_settings(cfg), api_key=api_key,
                         torch_threads=max(1, int(d.num_cpus)),
                         expert_balance_threshold=d.expert_balance_threshold,
                         tracking_uri=cfg.tracking.uri)


def deploy(cfg: PipelineConfig, settings, *, wait_s: float = 120.0) -> dict:
    """Start the app on the current Ray (must be initialised), smoke-test it; the record."""
    from moeflow.serving.app import free_port, start

    d = cfg.deploy
    port = d.port or free_port()
    url = start(settings, host=d.host, port=port, num_replicas=d.num_replicas or 1,
                max_ongoing_requests=d.max_ongoing_requests, num_cpus=d.num_cpus,
                allow_unauthenticated=d.allow_unauthenticated)
    smoke = smoke_test(url, settings.api_key, d.smoke_max_tokens, wait_s)
    return {"url": url, "models": [m["id"] for m in smoke["models"]], "smoke": smoke,
            "mode": "merged" if settings.merge else "shared", "app_name": "moeflow"}


def smoke_test(url: str, api_key: str | None, max_tokens: int = 4, wait_s: float = 120.0) -> dict:
    """One greedy completion per served model + a metrics scrape; UserError on any failure."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        while True:
            try:
                resp = client.get("/v1/models")
                if resp.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"deploy: {url}/v1/models did not answer within {wait_s:.0f} s")
            time.sleep(0.5)
        models = resp.json()["data"]
        results = {}
        for card in models:
            t0 = time.monotonic()
            r = client.post("/v1/completions", json={"model": card["id"], "prompt": "Hello",
                                                      "max_tokens": max_tokens, "temperature": 0})
            if r.status_code != 200:
                raise UserError(f"deploy smoke test: model {card['id']} answered {r.status_code}: {r.text[:200]}")
            body = r.json()
            results[card["id"]] = {"latency_s": round(time.monotonic() - t0, 4),
                                   "text": body["choices"][0]["text"],
                                   "completion_tokens": body["usage"]["completion_tokens"]}
        scrape = client.get("/metrics").text
        if "moeflow_time_to_first_token_seconds" not in scrape:
            raise UserError(f"deploy smoke test: {url}/metrics lacks moeflow_time_to_first_token_seconds")
    return {"models": [{"id": m["id"], "parent": m.get("parent")} for m in models],
            "completions": results, "metrics_ok": True}


def apply_plan(cfg: PipelineConfig, serving: dict | None) -> PipelineConfig:
    """Replicas from the plan's inference DP degree unless `deploy.num_replicas` is set.

    A replica holds a whole copy of the base (the transformers engine has no TP/EP
    inside a replica, so the planner keeps those at 1 on this runtime); per-replica
    CPUs shrink so the planned replicas fit what Ray has free next to this stage.
    """
    import ray

    d = cfg.deploy
    if d.num_replicas is not None:
        return cfg
    replicas = int((serving or {}).get("num_replicas") or 1)
    free = ray.available_resources().get("CPU", d.num_cpus)
    cpus = d.num_cpus
    if replicas * cpus > free:
        cpus = max(0.25, (free // (0.25 * replicas)) * 0.25)
        if replicas * cpus > free:
            replicas = 1
    return cfg.model_copy(update={"deploy": d.model_copy(update={"num_replicas": replicas,
                                                                   "num_cpus": cpus})})


def run(ctx: StageContext) -> dict:
    """Deploy the pipeline's converted model and fine-tuned adapter; smoke-test it."""
    import mlflow
    import ray

    from moeflow.serving.app import api_key_from_env

    if not ray.is_initialized():
        raise UserError("the deploy stage needs a Ray runtime (run it through `moeflow run` or "
                        "`moeflow deploy`)")
    regress = ctx.inputs.get("regress")
    if regress is not None and regress.get("passed") is False:
        raise UserError("deploy: the regress stage did not pass; refusing to deploy")
    base_dir = ctx.input("convert")["output_dir"]
    ft = ctx.input("finetune")
    source = ft.get("adapter_dir")
    if not source and ft.get("registered_model") and ft.get("model_version"):
        source = f"models:/{ft['registered_model']}/{ft['model_version']}"
    adapter = (ft.get("adapter_name") or "adapter", source) if source else None
    cfg = apply_plan(ctx.config, ctx.inputs.get("plan", {}).get("plan", {}).get("serving"))
    settings = build_settings(cfg, base_dir, adapter, api_key_from_env(cfg.deploy.api_key_env),
                              tenants=tenant_adapters(ft))
    record = deploy(cfg, settings)
    record["replicas"] = {"num_replicas": cfg.deploy.num_replicas, "num_cpus": cfg.deploy.num_cpus,
                          "from": "config" if ctx.config.deploy.num_replicas else "plan"}
    record["served"] = ", ".join(record["models"])  # one line in the run summary
    # the operators stage's choice; the serving engine loads with transformers' default
    # (grouped_mm) until ServeSettings carries an experts implementation
    impl = (ctx.inputs.get("operators", {}).get("experts_implementation") or {}).get("serving")
    record["experts_implementation"] = impl or "grouped_mm"
    ctx.write_json("deployment.json", record)
    if mlflow.active_run():
        mlflow.log_dict(record["smoke"], "smoke.json")
        mlflow.set_tag("moeflow.deploy.url", record["url"])
        mlflow.log_param("experts_implementation", record["experts_implementation"])
        for name, res in record["smoke"]["completions"].items():
            mlflow.log_metric(f"smoke_latency_s.{name}", res["latency_s"])
    return record


STAGE = StageSpec(
    name="deploy", run=run, upstream=("convert", "plan", "finetune", "regress", "operators"),
    sections=("model", "deploy", "lora"), num_cpus=0.5,
    cacheable=False,  # the result is a live endpoint: a cached record would point at nothing
    description="Ray Serve OpenAI endpoint: shared base + LoRA adapters (or merged), smoke-tested",
)
