"""The local backend's deployment on Ray Serve: settings, replicas, start, smoke test.

Shared by the deploy stage (tasks/deploy.py) and `moeflow deploy` / `moeflow serve`
(workflows/commands/deploy.py); what is served comes from `moeflow.serving.deployment.decide`.

    dep = decide(cfg, records)
    cfg = apply_plan(cfg, plan_serving)                 # replicas (needs Ray)
    record = deploy(cfg, settings_for(cfg, dep, api_key))
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any, Callable

from moeflow.core.config import PipelineConfig
from moeflow.core.devices import gpus_per_worker
from moeflow.core.errors import UserError
from moeflow.core.ports import free_port
from moeflow.serving.deployment import Deployment, engine_settings
from moeflow.serving.ingress import active_ingress

if TYPE_CHECKING:
    from moeflow.serving.app import ServeSettings


def settings_for(cfg: PipelineConfig, dep: Deployment, api_key: str | None,
                 stored: dict[str, str] | None = None, allow_ungated: bool = False) -> ServeSettings:
    """ServeSettings of a decided deployment.

    Args:
        cfg: pipeline config (`deploy:` knobs; serving.yaml already applied or named in
            deploy.serving_config).
        dep: what to serve (`decide`).
        api_key: bearer token required by the API (None: open).
        stored: local path -> store URI of what the stage fetched (StageContext.stored), so
            replicas on other nodes fetch the base and adapters themselves.
        allow_ungated: `--force`: runtime loads of registered versions without a PASS gate
            verdict are served (and logged), not refused.
    """
    from moeflow.core.tracking import resolve_tracking_uri  # imports MLflow (seconds)
    from moeflow.serving.app import ServeSettings  # imports the engine (torch): only when serving

    d = cfg.deploy
    return ServeSettings(base_dir=dep.checkpoint, served_model_name=dep.served_model_name,
                         adapters=dict(dep.adapters), stored=stored or {}, adapter_root=d.adapter_root,
                         merge=dep.merge, dtype=d.dtype, engine=engine_settings(cfg) | {
                             "compile": d.compile, "max_cpu_loras": d.max_cpu_loras,
                             "pinned_adapters": [] if dep.merge else list(d.pinned_adapters),
                             "enable_prefix_caching": d.enable_prefix_caching},
                         api_key=api_key,
                         torch_threads=max(1, int(d.num_cpus)), stream_interval=d.stream_interval,
                         expert_balance_threshold=d.expert_balance_threshold,
                         # resolved here: a replica's working directory is not the project's
                         # not created: `serve` with no store asked for writes none
                         tracking_uri=resolve_tracking_uri(cfg.tracking.uri, create=False),
                         experts_implementation=dep.experts_implementation, ep_size=dep.ep_size,
                         engine_process=d.engine_process, allow_ungated=allow_ungated)


def apply_plan(cfg: PipelineConfig, serving: dict | None) -> PipelineConfig:
    """Replicas from the plan's inference DP degree unless `deploy.num_replicas` is set.

    A replica holds a whole copy of the base (the transformers engine has no TP/EP
    inside a replica, so the planner keeps those at 1 on this runtime); per-replica
    CPUs shrink so the planned replicas fit what Ray has free next to this stage.
    """
    import ray  # seconds to import; the caller has started it

    d = cfg.deploy
    if d.num_replicas is not None:
        return cfg
    replicas = int((serving or {}).get("num_replicas") or 1)
    per = gpus_per_worker(d.num_gpus)
    if per > 0:  # a replica per free GPU at most: more would never start
        replicas = max(1, min(replicas, int(ray.available_resources().get("GPU", 0) // per)))
    free = ray.available_resources().get("CPU", d.num_cpus)
    cpus = d.num_cpus
    if replicas * cpus > free:
        cpus = max(0.25, (free // (0.25 * replicas)) * 0.25)
        if replicas * cpus > free:
            replicas = 1
    return cfg.model_copy(update={"deploy": d.model_copy(update={"num_replicas": replicas,
                                                                   "num_cpus": cpus})})


def port_taken(host: str, port: int) -> bool:
    """True when something already listens on host:port (and it is not this Ray's own
    Serve proxy, which a second deploy reuses)."""
    import ray  # seconds to import; the caller has started it

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


def pick_port(cfg: PipelineConfig, notify: Callable[[str], Any] = print) -> int:
    """deploy.port, or a free port when it is 0 or taken (said in one line through `notify`)."""
    d = cfg.deploy
    port = d.port or free_port()
    if d.port and port_taken(d.host, d.port):
        port = free_port()
        notify(f"port {d.port} is in use; serving on http://{d.host}:{port} instead "
               "(set deploy.port to choose one)")
    return port


def deploy(cfg: PipelineConfig, settings: ServeSettings, *, wait_s: float = 120.0,
           notify: Callable[[str], Any] = print) -> dict:
    """Start the app on the current Ray (must be initialised), smoke-test it; the record.

    deploy.port (default 8000) taken by another program: a free port instead, said in
    one line through `notify`."""
    from moeflow.serving import app  # imports the engine (torch): only when serving

    d = cfg.deploy
    port = pick_port(cfg, notify)
    url = app.start(settings, host=d.host, port=port, num_replicas=d.num_replicas or 1,
                    max_ongoing_requests=d.max_ongoing_requests, num_cpus=d.num_cpus,
                    allow_unauthenticated=d.allow_unauthenticated, num_gpus=gpus_per_worker(d.num_gpus))
    smoke = smoke_test(url, settings.api_key, d.smoke_max_tokens, wait_s)
    return {"url": url, "models": [m["id"] for m in smoke["models"]], "smoke": smoke,
            "mode": "merged" if settings.merge else "shared", "app_name": "moeflow",
            "ingress": active_ingress()}  # what the Ray this process started serves through


def _still_deploying(cap: float) -> bool:
    """True while Serve reports the app as still deploying (a replica loading on a busy
    host: minutes), up to `cap` (time.monotonic); a failed or absent app is not waited for."""
    if time.monotonic() > cap:
        return False
    try:
        from ray import serve  # seconds to import; only while waiting for a slow replica

        app = serve.status().applications.get("moeflow")
    except Exception:  # no Serve in this process (an endpoint elsewhere): the plain limit
        return False
    return app is not None and str(app.status).endswith("DEPLOYING")


def smoke_test(url: str, api_key: str | None, max_tokens: int = 4, wait_s: float = 120.0,
               metric: str | None = "moeflow_time_to_first_token_seconds") -> dict:
    """One greedy completion per served model + a scrape of /metrics for `metric` (None: no
    scrape: Ray Serve LLM exports vLLM's metrics through Ray's, not on the API's port);
    UserError on any failure."""
    import httpx  # only a deployment needs an HTTP client

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
        if metric and metric not in client.get("/metrics").text:
            raise UserError(f"deploy smoke test: {url}/metrics lacks {metric}")
    return {"models": [{"id": m["id"], "parent": m.get("parent")} for m in models],
            "completions": results, "metrics_ok": True if metric else None}
