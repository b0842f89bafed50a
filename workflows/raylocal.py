"""Connect to the configured Ray cluster, or start a local Ray in-process."""

from __future__ import annotations

import contextlib
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
    if ray.is_initialized():
        yield
        return
    from workflows.verbosity import configure, quiet_ray_errors, ray_init_kwargs

    configure()
    quiet = ray_init_kwargs()  # worker output on the terminal only with -v
    addr = ray_address(cfg, address)
    if addr:
        ray.init(address=addr, **quiet)
    else:
        temp_dir = (cfg.ray.temp_dir if cfg else None) or os.environ.get("MOEFLOW_RAY_TEMP_DIR")
        num_cpus = (cfg.ray.num_cpus if cfg else None) or max(2, os.cpu_count() or 1)
        ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, **quiet)
    quiet_ray_errors()  # `(raylet) ...` error lines: to the ray logger unless -v
    try:
        yield
    finally:
        ray.shutdown()
