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


SERVING_KEYS = ENGINE_KEYS + ("num_replicas", "max_ongoing_requests")  # what serving.yaml may set


def read_serving_yaml(path: str | Path) -> dict:
    """The knobs of a serving.yaml (serving stage): deploy: names, flat or under `engine:`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"deploy.serving_config: {path} does not exist")
    tuned = yaml.safe_load(path.read_text()) or {}
    tuned = tuned.get("engine", tuned) if isinstance(tuned, dict) else None
    if not isinstance(tuned, dict):
        raise UserError(f"{path}: expected a mapping of engine settings")
    unknown = sorted(set(tuned) - set(SERVING_KEYS))
    if unknown:
        raise UserError(f"{path}: unknown engine setting {unknown[0]!r}; known: {', '.join(SERVING_KEYS)}")
    return tuned


def apply_serving(cfg: PipelineConfig, path: str | Path | None) -> tuple[PipelineConfig, dict[str, str]]:
    """`cfg` with serving.yaml's knobs applied, except those `deploy:` sets explicitly.

    Returns:
        (config, {knob: "serving.yaml" | "deploy (explicit, wins over serving.yaml)"}).
    """
    if not path:
        return cfg, {}
    tuned = read_serving_yaml(path)
    explicit = cfg.deploy.model_fields_set
    sources = {k: "deploy (explicit, wins over serving.yaml)" if k in explicit else "serving.yaml"
               for k in tuned}
    update = {k: v for k, v in tuned.items() if k not in explicit}
    update["serving_config"] = None  # applied; not again
    from pydantic import ValidationError

    try:  # from the explicit fields only, so the result still knows which ones those are
        deploy_ = type(cfg.deploy).model_validate({**cfg.deploy.model_dump(exclude_unset=True), **update})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UserError(f"{path}: `{'.'.join(map(str, err['loc']))}`: {err['msg']}") from None
    return cfg.model_copy(update={"deploy": deploy_}), sources


def engine_settings(cfg: PipelineConfig) -> dict:
    """Engine knobs from `deploy:`, with the serving stage's serving.yaml applied if named."""
    cfg, _ = apply_serving(cfg, cfg.deploy.serving_config)
    return {k: getattr(cfg.deploy, k) for k in ENGINE_KEYS}


def placement_ep(operators: dict | None) -> int:
    """The EP size the operators stage placed experts for (1: no such stage)."""
    return int((operators or {}).get("ep_size") or 1)


def serving_experts_impl(operators: dict | None) -> str | None:
    """The operators stage's experts implementation for serving (None: no such stage)."""
    return ((operators or {}).get("experts_implementation") or {}).get("serving")


def tenant_adapters(finetune: dict | None) -> dict[str, str]:
    """{name: dir} of a finetune record's tenant adapters (finetune.adapters), main one excluded."""
    adapters = (finetune or {}).get("adapters") or {}
    return {name: a["adapter_dir"] for name, a in adapters.items() if a.get("tenant")}


def build_settings(cfg: PipelineConfig, base_dir: str, adapter: tuple[str, str] | None,
                   api_key: str | None, tenants: dict[str, str] | None = None,
                   experts_implementation: str | None = None, stored: dict[str, str] | None = None,
                   ep_size: int = 1):
    """ServeSettings from the config and the upstream records.

    Args:
        cfg: pipeline config (`deploy:` section).
        base_dir: converted checkpoint dir.
        adapter: (name, dir or models:/ URI) of the fine-tuned adapter, if any.
        api_key: bearer token required by the API (None: open).
        tenants: more fine-tuned adapters {name: dir} served beside it (shared mode).
        experts_implementation: transformers experts kernel to serve with (the operators
            stage's serving choice; None: transformers' default).
        stored: local path -> store URI of what the stage fetched (StageContext.stored), so
            replicas on other nodes fetch the base and adapters themselves.
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
    return ServeSettings(base_dir=base_dir, served_model_name=name, adapters=adapters, stored=stored or {},
                         adapter_root=d.adapter_root, merge=adapter[0] if d.merge else None,
                         dtype=d.dtype, engine=engine_settings(cfg), api_key=api_key,
                         torch_threads=max(1, int(d.num_cpus)), stream_interval=d.stream_interval,
                         expert_balance_threshold=d.expert_balance_threshold,
                         tracking_uri=_tracking_uri(cfg), experts_implementation=experts_implementation,
                         ep_size=ep_size)


def _tracking_uri(cfg: PipelineConfig) -> str:
    """The project's store (config, $MLFLOW_TRACKING_URI, else sqlite:///<abs>/mlruns/mlflow.db),
    resolved here: a replica's working directory is not the project's."""
    from moeflow.tracking import resolve_tracking_uri  # local: workflows imports tasks

    return resolve_tracking_uri(cfg.tracking.uri)


def port_taken(host: str, port: int) -> bool:
    """True when something already listens on host:port (and it is not this Ray's own
    Serve proxy, which a second deploy reuses)."""
    import socket

    import ray

    if ray.is_initialized():
        try:
            ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
            return False  # Serve runs here already: its proxy holds the port for us
        except ValueError:
            pass
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the proxy binds
        try:
            sock.bind(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port))
        except OSError:
            return True
    return False


def deploy(cfg: PipelineConfig, settings, *, wait_s: float = 120.0, notify=print) -> dict:
    """Start the app on the current Ray (must be initialised), smoke-test it; the record.

    deploy.port (default 8000) taken by another program: a free port instead, said in
    one line through `notify`."""
    from moeflow.devices import gpus_per_worker
    from moeflow.serving.app import free_port, start

    d = cfg.deploy
    port = d.port or free_port()
    if d.port and port_taken(d.host, d.port):
        port = free_port()
        notify(f"port {d.port} is in use; serving on http://{d.host}:{port} instead "
               "(set deploy.port to choose one)")
    url = start(settings, host=d.host, port=port, num_replicas=d.num_replicas or 1,
                max_ongoing_requests=d.max_ongoing_requests, num_cpus=d.num_cpus,
                allow_unauthenticated=d.allow_unauthenticated, num_gpus=gpus_per_worker(d.num_gpus))
    smoke = smoke_test(url, settings.api_key, d.smoke_max_tokens, wait_s)
    from moeflow.serving.ingress import active_ingress

    return {"url": url, "models": [m["id"] for m in smoke["models"]], "smoke": smoke,
            "mode": "merged" if settings.merge else "shared", "app_name": "moeflow",
            "ingress": active_ingress()}  # what the Ray this process started serves through


def _still_deploying(cap: float) -> bool:
    """True while Serve reports the app as still deploying (a replica loading on a busy
    host: minutes), up to `cap` (time.monotonic); a failed or absent app is not waited for."""
    if time.monotonic() > cap:
        return False
    try:
        from ray import serve

        app = serve.status().applications.get("moeflow")
    except Exception:  # no Serve in this process (an endpoint elsewhere): the plain limit
        return False
    return app is not None and str(app.status).endswith("DEPLOYING")


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
            if time.monotonic() > deadline and not _still_deploying(deadline + 4 * wait_s):
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
    from moeflow.devices import gpus_per_worker

    if gpus_per_worker(d.num_gpus) > 0:  # a replica per free GPU at most: more would never start
        replicas = max(1, min(replicas, int(ray.available_resources().get("GPU", 0) // gpus_per_worker(d.num_gpus))))
    free = ray.available_resources().get("CPU", d.num_cpus)
    cpus = d.num_cpus
    if replicas * cpus > free:
        cpus = max(0.25, (free // (0.25 * replicas)) * 0.25)
        if replicas * cpus > free:
            replicas = 1
    return cfg.model_copy(update={"deploy": d.model_copy(update={"num_replicas": replicas,
                                                                   "num_cpus": cpus})})


def _refuse_failed_regress(ctx: StageContext) -> None:
    regress = ctx.inputs.get("regress")
    if regress is not None and regress.get("passed") is False:
        raise UserError("deploy: the regress stage did not pass; refusing to deploy")


def run(ctx: StageContext) -> dict:
    """Deploy the pipeline's converted model and fine-tuned adapter; smoke-test it."""
    import mlflow
    import ray

    from moeflow.serving.app import api_key_from_env

    if ctx.config.deploy.backend == "vllm":  # a Ray Serve LLM app (moeflow/serving/vllm_backend.py)
        from moeflow.serving.vllm_backend import deploy_stage

        _refuse_failed_regress(ctx)
        return deploy_stage(ctx)
    if not ray.is_initialized():
        raise UserError("the deploy stage needs a Ray runtime (run it through `moeflow run` or "
                        "`moeflow deploy`)")
    _refuse_failed_regress(ctx)
    base_dir = ctx.input("convert")["output_dir"]
    if ctx.config.deploy.weights == "calibrated":  # the quantised checkpoint (compressed-tensors)
        from tasks.calibrate import calibrated_checkpoint
        base_dir = calibrated_checkpoint(ctx.inputs.get("calibrate"))
    ft = ctx.input("finetune")
    source = ft.get("adapter_dir")
    if not source and ft.get("registered_model") and ft.get("model_version"):
        source = f"models:/{ft['registered_model']}/{ft['model_version']}"
    adapter = (ft.get("adapter_name") or "adapter", source) if source else None
    # serving.yaml: the user's deploy.serving_config, else the serving stage's (explicit deploy: wins)
    tuned = ctx.config.deploy.serving_config or ctx.inputs.get("serving", {}).get("serving_yaml")
    cfg, sources = apply_serving(ctx.config, tuned)
    cfg = apply_plan(cfg, ctx.inputs.get("plan", {}).get("plan", {}).get("serving"))
    impl = serving_experts_impl(ctx.inputs.get("operators"))
    settings = build_settings(cfg, base_dir, adapter, api_key_from_env(cfg.deploy.api_key_env),
                              tenants=tenant_adapters(ft), experts_implementation=impl,
                              ep_size=placement_ep(ctx.inputs.get("operators")), stored=ctx.stored)
    record = deploy(cfg, settings, notify=ctx.note)
    record["replicas"] = {"num_replicas": cfg.deploy.num_replicas, "num_cpus": cfg.deploy.num_cpus,
                          "from": "serving.yaml" if sources.get("num_replicas") == "serving.yaml"
                          else "config" if ctx.config.deploy.num_replicas else "plan"}
    serving = ctx.inputs.get("plan", {}).get("plan", {}).get("serving") or {}
    if max(serving.get(k) or 1 for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel")) > 1:
        record["plan_not_applied"] = ("the plan serves with TP/PP/EP > 1; the local backend holds a whole "
                                      "model per replica: deploy.backend vllm applies them")
    record["serving_yaml"] = {"path": str(tuned) if tuned else None, "knobs": sources}
    record["served"] = ", ".join(record["models"])  # one line in the run summary
    record["experts_implementation"] = impl or "grouped_mm"  # the operators stage's, else transformers' default
    ctx.write_json("deployment.json", record)
    if mlflow.active_run():
        mlflow.log_dict(record["smoke"], "smoke.json")
        mlflow.set_tag("moeflow.deploy.url", record["url"])
        _log_serving(tuned, sources, cfg)
        mlflow.log_param("experts_implementation", record["experts_implementation"])
        mlflow.log_param("ingress", record["ingress"])
        for name, res in record["smoke"]["completions"].items():
            mlflow.log_metric(f"smoke_latency_s.{name}", res["latency_s"])
    return record


def _log_serving(path, sources: dict[str, str], cfg: PipelineConfig) -> None:
    """MLflow params: which knobs came from serving.yaml, which the config overrode, the values used."""
    import mlflow

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
