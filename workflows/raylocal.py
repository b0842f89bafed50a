"""Connect to the configured Ray cluster, or start a local Ray in-process."""

from __future__ import annotations

import contextlib
import logging
import os

import ray

from moeflow.config import PipelineConfig


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
    from moeflow.serving.ingress import ingress_environment
    from workflows.verbosity import configure, quiet_ray_errors, ray_init_kwargs

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
            stack.enter_context(ingress_environment(ingress))  # Ray's processes read it at start
            ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, **quiet)
        quiet_ray_errors()  # `(raylet) ...` error lines: to the ray logger unless -v
        try:
            yield
        finally:
            ray.shutdown()


def _ingress_note(ingress: str, why: str) -> None:
    """deploy.ingress haproxy on a Ray moeflow did not start: its own environment decides."""
    from moeflow.serving.ingress import HAPROXY_FLAGS, active_ingress

    if ingress == "haproxy" and active_ingress() != "haproxy":
        flags = " ".join(f"{k}={v}" for k, v in HAPROXY_FLAGS.items())
        logging.getLogger("moeflow").warning(
            "deploy.ingress haproxy: %s, so Serve uses the ingress it was started with; "
            "start it with %s for HAProxy", why, flags)
