"""Connect to the configured Ray cluster, or start a local Ray in-process."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading

import ray

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
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
            join_ray(addr)
        else:
            temp_dir = (cfg.ray.temp_dir if cfg else None) or os.environ.get("MOEFLOW_RAY_TEMP_DIR")
            num_cpus = (cfg.ray.num_cpus if cfg else None) or max(2, os.cpu_count() or 1)
            own_dir = stack.enter_context(ingress_environment(ingress))  # Ray's processes read it at start
            try:
                ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, **quiet)
            except Exception as exc:  # Ray's own start-up failure (a busy host): one line, not its traceback
                from moeflow.core.errors import UserError

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


def join_ray(address: str) -> None:
    """ray.init(address=...) with the auth a Ray on this machine uses; failures in one line.

    Ray turns token auth on for a cluster `ray.init()` starts (moeflow's local Ray: the token
    in ~/.ray/auth_token), and for a driver joining a local cluster it finds itself
    (`address="auto"`), but never for a named address: `--address 127.0.0.1:PORT` of that
    same Ray was refused. A named address on this machine gets Ray's own rule (token mode
    when a token is there and RAY_AUTH_MODE is unset); a remote one is left to RAY_AUTH_MODE,
    so a local token is never sent elsewhere.

    Raises:
        UserError: nothing listens there, or Ray refused the connection (its token).
    """
    host, port = _gcs_endpoint(address)
    if host is not None:
        _probe(address, host, port)
        if _on_this_machine(host):
            # lazy: Ray's auth setup (pinned Ray: a private module) is needed only to join
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available,
            )

            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    try:
        ray.init(address=address, **ray_init_kwargs())
    except Exception as exc:  # Ray's refusal (auth, version) is a traceback: one line instead
        from moeflow.core.errors import UserError

        ray.shutdown()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot join the Ray cluster at {address}: {first[:300]} "
                        "(moeflow -v shows Ray's error)") from exc


def ray_address_line() -> str:
    """Where this process's Ray is, as `--address` of another command takes it."""
    return ray.get_runtime_context().gcs_address


def _gcs_endpoint(address: str) -> tuple[str | None, int]:
    """(host, port) of a `host:port` or `ray://host:port` address; (None, 0) for `auto`/`local`."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None, 0
    return host.strip("[]"), int(port)


def _probe(address: str, host: str, port: int, timeout_s: float = 3.0) -> None:
    """Raise UserError in one line when nothing answers at host:port (Ray itself would retry
    for minutes, printing its own warnings)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        raise UserError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} "
                        "(is it running? `moeflow deploy` / `serve` print the address)") from None


def _on_this_machine(host: str) -> bool:
    """True when `host` is one of this machine's addresses (a socket can bind to it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


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
