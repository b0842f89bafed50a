"""Connect to the configured Ray cluster, or start a local Ray in-process."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import ray

from moeflow.config import PipelineConfig
from moeflow.serving.ingress import HAPROXY_FLAGS, active_ingress, ingress_environment, stop_haproxy
from workflows.reaper import reap_session, release, watch_session
from workflows.verbosity import configure, quiet_ray_errors, ray_init_kwargs


def ray_address(cfg: PipelineConfig | None, address: str | None = None) -> str | None:
    """--address, else ray.address in the config, else $RAY_ADDRESS, else None (local)."""
    return address or (cfg.ray.address if cfg else None) or os.environ.get("RAY_ADDRESS") or None


@contextlib.contextmanager
def ray_session(cfg: PipelineConfig | None = None, address: str | None = None):
    """Yield with Ray initialised; shut down only what this call started.

    An already-initialised Ray (a test fixture, a Ray job driver) is used as is.
    """
    ingress = cfg.deploy.ingress if cfg else "auto"
    if ray.is_initialized():
        _ingress_note(ingress, "this Ray was started before")
        yield
        return

    configure()
    quiet = ray_init_kwargs()  # worker output on the terminal only with -v
    addr = ray_address(cfg, address)
    with contextlib.ExitStack() as stack:
        if addr:
            _ingress_note(ingress, f"the cluster at {addr} was started before")
            ray.init(address=addr, **quiet)
        else:
            temp_dir = (cfg.ray.temp_dir if cfg else None) or os.environ.get("MOEFLOW_RAY_TEMP_DIR")
            num_cpus = (cfg.ray.num_cpus if cfg else None) or max(2, os.cpu_count() or 1)
            own_dir = stack.enter_context(ingress_environment(ingress))  # Ray's processes read it at start
            try:
                ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, **quiet)
            except Exception as exc:  # Ray's own start-up failure (a busy host): one line, not its traceback
                from moeflow.errors import UserError

                ray.shutdown()  # what it did start (GCS, raylet) goes too

                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise UserError(f"a local Ray did not start: {first} (moeflow -v shows Ray's error)") from exc
            # a SIGKILL of this process runs no `finally`: the watcher stops what Ray leaves behind
            node = ray._private.worker._global_node
            watcher = watch_session(node.get_session_dir_path(), own_dir) if node is not None else None
            if watcher is not None:
                stack.callback(release, watcher)  # after stop_local_ray: nothing left for it to do
        quiet_ray_errors()  # `(raylet) ...` error lines: to the ray logger unless -v
        try:
            yield
        finally:
            if addr:
                ray.shutdown()
            else:
                stop_local_ray()


def stop_local_ray(grace_s: float = 5.0) -> None:
    """Stop the Ray this process started, fast and completely: HAProxy first (the API port is
    free at once), then Ray, then any process of its session left behind (a Serve replica or
    HAProxyManager that outlives its raylet keeps ports bound). Ctrl-C and SIGTERM are held off
    meanwhile: a second one must not leave half a cluster behind."""


    held = _hold_signals()
    try:
        node = getattr(ray._private.worker, "_global_node", None)
        session = node.get_session_dir_path() if node is not None else None
        stop_haproxy()
        ray.shutdown()
        stop_haproxy()  # one the Serve controller restarted in between
        if session:
            reap_session(session, grace_s)
    finally:
        for sig, old in held.items():
            signal.signal(sig, old)


def _hold_signals() -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}


def _ingress_note(ingress: str, why: str) -> None:
    """deploy.ingress haproxy on a Ray moeflow did not start: its own environment decides."""

    if ingress == "haproxy" and active_ingress() != "haproxy":
        flags = " ".join(f"{k}={v}" for k, v in HAPROXY_FLAGS.items())
        logging.getLogger("moeflow").warning(
            "deploy.ingress haproxy: %s, so Serve uses the ingress it was started with; "
            "start it with %s for HAProxy", why, flags)
