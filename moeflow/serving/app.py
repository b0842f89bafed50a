"""Build and start the Ray Serve application: shared base + LoRA adapters.

    from moeflow.serving.app import ServeSettings, start
    url = start(ServeSettings(base_dir="work/convert", adapters={"a": "work/adapter"}))

`ServeSettings` and `Service` (service.py) say what to serve and what one
replica holds; here `MoeflowServer` is the Ray Serve deployment of a
`Service` whose ingress is the OpenAI-compatible FastAPI app of
`moeflow.serving.api`, and `start` deploys it behind Serve's HTTP proxy.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from pathlib import Path

from moeflow.core import storage
from moeflow.core.errors import UserError
from moeflow.core.ports import free_port  # in __all__: the tests and benchmarks that start an app take it here
from moeflow.model.anatomy import check_config_values
from moeflow.model.params import load_config_json
from moeflow.serving.adapter_sync import open_book, reset_book
from moeflow.serving.loadbook import Reporter
from moeflow.serving.preflight import replica_failure
from moeflow.serving.service import ServeSettings, Service, on_this_node

__all__ = ["APP_NAME", "DRAIN_S", "ServeSettings", "Service", "api_key_from_env", "build_app", "check_bind",
           "drain", "free_port", "serve_failure", "start"]

log = logging.getLogger("moeflow.serving")
APP_NAME = "moeflow"
DRAIN_S = 20.0  # how long a stopping server lets requests in flight finish (Serve's graceful shutdown)


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Refuse serving beyond loopback without an API key (unless explicitly allowed)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key and not allow_unauthenticated:
        raise UserError(f"deploy.host {host!r} is reachable from other machines but no API key is set; "
                        f"set $MOEFLOW_API_KEY (or --api-key), or deploy.allow_unauthenticated: true")


# ------------------------------------------------------------------ Ray Serve


def _deployment_class():
    # lazy: ray: heavy, loaded only when this runs
    from ray import serve

    @serve.deployment
    @serve.ingress()
    class MoeflowServer:
        """Ray Serve replica: one engine over one copy of the base model."""

        def __init__(self, settings: dict):
            logging.basicConfig(level=logging.INFO)
            self.service = Service(ServeSettings(**settings), ray_metrics=True, book=open_book(APP_NAME))

            # live expert load for `moeflow rebalance`, summed over replicas there
            replica = serve.get_replica_context().replica_id.to_full_id_str()
            self.reporter = Reporter(APP_NAME, replica, self.service.experts, settings)

        def __serve_build_asgi_app__(self):
            # lazy: loads fastapi, starlette, which importing this module does not
            from moeflow.serving.api import create_app

            return create_app(self.service)

        def check_health(self) -> None:
            """Ray Serve replaces the replica when this raises (engine dead or its thread gone)."""
            self.service.engine.health()

        def __del__(self):
            self.reporter.stop()
            self.service.close()

    return MoeflowServer


def build_app(settings: ServeSettings, *, num_replicas: int = 1, max_ongoing_requests: int = 32,
              num_cpus: float = 1, num_gpus: float = 0):
    """The bound Ray Serve application (pass to `serve.run`); `num_gpus` per replica."""
    cls = _deployment_class()
    return cls.options(num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                       graceful_shutdown_timeout_s=DRAIN_S,
                       ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus}
                       ).bind(settings.model_dump())


def check_base(settings: ServeSettings) -> None:
    """The base is a model directory with a usable config.json (UserError naming it). Of a base
    in a store only config.json is fetched: the replicas fetch the checkpoint on their nodes."""
    try:
        config = Path(on_this_node(storage.join(settings.base_dir, "config.json"), settings.stored))
        found = config.is_file()
    except UserError:  # a store output without it
        found = False
    if not found:
        raise UserError(f"{settings.base_dir}: not a model directory (no config.json)")
    check_config_values(load_config_json(config), f"{settings.base_dir}/config.json")


def start(settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000, num_replicas: int = 1,
          max_ongoing_requests: int = 32, num_cpus: float = 1, allow_unauthenticated: bool = False,
          num_gpus: float = 0) -> str:
    """Start Serve's HTTP proxy and deploy the app (Ray must be initialised). Returns the base URL."""
    # lazy: ray: heavy, loaded only when this runs
    from ray import serve

    check_bind(host, settings.api_key, allow_unauthenticated)
    check_base(settings)  # said here, not as a replica's failure
    reset_book(APP_NAME)  # a new deployment starts with only its configured adapters
    from moeflow.serving.loadbook import remember_options, reset_load_book

    reset_load_book(APP_NAME)  # and with no expert load reports
    remember_options(APP_NAME, num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                     num_cpus=num_cpus, num_gpus=num_gpus)
    app = build_app(settings, num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                    num_cpus=num_cpus, num_gpus=num_gpus)
    try:
        _start_ingress(host, port)
        host, port = _serving_address(host, port, settings.api_key, allow_unauthenticated)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except UserError:
        raise
    except Exception as exc:  # Ray's own failure (its ingress, a port): one line, not Ray's traceback
        cause, details = _replica_failure()
        if cause:  # a replica's constructor raised: its own last line; -v prints the replica's traceback
            ray_error = RuntimeError(details)
            ray_error.__cause__ = exc
            raise UserError(f"the server did not start: {cause}") from ray_error
        raise UserError(f"Ray Serve did not start the app on {host}:{port}: {serve_failure(exc)} "
                        "(moeflow -v shows Ray's error)") from exc
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown}:{port}"


def _replica_failure() -> tuple[str | None, str]:
    """(cause, Ray's message) of the app's failed deployment: the replica's exception line and
    the traceback Serve keeps in the deployment's status (else only in the controller's log)."""
    # lazy: ray: heavy, loaded only when this runs
    from ray import serve

    try:
        status = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - the controller is gone too: the caller says what it has
        return None, ""
    details = "\n".join(d.message for d in (status.deployments.values() if status else ()) if d.message)
    return replica_failure(details), details


def _serving_address(host: str, port: int, api_key: str | None,
                     allow_unauthenticated: bool) -> tuple[str, int]:
    """Where the app is reachable: Serve already running on this Ray (an earlier deploy, a
    cluster's own) keeps its HTTP host and port -- serve.start ignores new ones with a log
    warning -- so the URL must be the running proxy's, not the one asked for (a deploy once
    smoke-tested a port nothing listened on for 120 s). A running proxy on a non-loopback
    host is checked as one this call would have bound."""
    # lazy: ray: heavy, loaded only when this runs; Ray is pinned (private client accessor)
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return host, port
    actual = (client.http_config.host, client.http_config.port)
    check_bind(actual[0], api_key, allow_unauthenticated)
    if actual != (host, port):
        log.warning("Ray Serve already runs on this Ray with HTTP %s:%s: the app is served there, "
                    "not on %s:%s", *actual, host, port)
    return actual


def _start_ingress(host: str, port: int) -> None:
    """serve.start; once more when Serve kills its own ingress actor while starting it
    (seen on a heavily loaded host: `killed by ray.kill`, `cancelled before it started`)."""
    # lazy: ray: heavy, loaded only when this runs
    from ray import serve
    from ray.exceptions import RayActorError

    try:
        serve.start(http_options={"host": host, "port": port})
    except RayActorError:
        serve.shutdown()
        serve.start(http_options={"host": host, "port": port})


def serve_failure(exc: BaseException) -> str:
    """The line of a Ray failure that says what went wrong (HAProxy's ALERT, else the last line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    alerts = [line for line in lines if "[ALERT]" in line and "Fatal errors" not in line]
    return (alerts or lines or [type(exc).__name__])[-1 if not alerts else 0][:400]


def drain(app_name: str = APP_NAME) -> None:
    """Delete the app the Serve way: its replicas take no new requests and finish those in flight,
    each for at most DRAIN_S (`graceful_shutdown_timeout_s`, build_app),
    then stop. Ray must be initialised; stopping Ray right away cuts every open request.

    Given up at once when Ray's GCS stops answering: a SIGTERM to the whole process group
    (systemd, a pod stop) stops Ray's own processes too, and a Serve call then waits 60 s for
    the GCS before Ray ends this process with exit 1, everything left running."""
    import threading

    import ray  # seconds to import; the caller has started it
    from ray import serve

    def delete():
        try:
            serve.delete(app_name, _blocking=True)
        except Exception:  # noqa: BLE001 - Serve already gone (its controller died): nothing to drain
            pass

    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    worker = threading.Thread(target=delete, name="moeflow-drain", daemon=True)
    worker.start()
    deadline = time.monotonic() + DRAIN_S + 10  # Serve's own bound, and its controller's work
    while worker.is_alive() and time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except OSError:
            return  # Ray is going down under us: nothing left to drain
        worker.join(timeout=0.5)



def api_key_from_env(env: str = "MOEFLOW_API_KEY") -> str | None:
    return os.environ.get(env) or None
