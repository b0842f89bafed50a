"""Stopping `moeflow serve` with HAProxy in front leaves nothing behind: SIGTERM to the command
or to its whole process group (systemd, a Kubernetes pod stop), during start-up while Serve
reloads HAProxy or once serving, and afterwards no HAProxy it started runs, nothing listens on
its port and no process of its Ray session is left. Repeated, since a reloaded HAProxy survived
2 stops in 3 before (benchmarks/bench_stop.py runs the same check 10 times)."""

from __future__ import annotations

import random

import pytest
import yaml

from moeflow_testing.tiny import build_debug_model


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("when,group", [("start-up", True), ("serving", True), ("start-up", False),
                                        ("serving", False)])
def test_sigterm_leaves_no_haproxy_no_port_no_ray_process(tmp_path, when, group):
    from benchmarks.bench_stop import one_stop

    random.seed(hash((when, group)))
    base = build_debug_model("qwen3_moe", tmp_path / "m")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "model": {"path": str(base)},
                                      "deploy": {"num_replicas": 1, "port": 0}}))
    res = one_stop(config, tmp_path, when, group)
    assert res["ok"], res
    assert res["haproxy_started"] >= 1 and res["port"]
    assert res["seconds"] < 30, res  # Serve's controller alone used to take 30-40 s


@pytest.mark.slow
@pytest.mark.integration
def test_a_crashed_driver_leaves_no_haproxy_no_port(tmp_path):
    """SIGKILL of `moeflow serve` (no cleanup of its own): HAProxy dies with its Serve actor."""
    from benchmarks.bench_stop import one_stop

    base = build_debug_model("qwen3_moe", tmp_path / "m")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "model": {"path": str(base)},
                                      "deploy": {"num_replicas": 1, "port": 0}}))
    res = one_stop(config, tmp_path, "serving", False, crash=True)
    assert res["ok"], res


def test_stop_haproxy_kills_only_the_wrappers_own_pids(tmp_path):
    """The pid file names processes; one counts only while its command line names the dir."""
    import subprocess
    import sys

    from moeflow.serving.ingress import PIDS_NAME, haproxy_pids, stop_haproxy

    files = tmp_path / "hap"
    files.mkdir()
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(files / "x.cfg")])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (files / PIDS_NAME).write_text(f"{ours.pid}\n{other.pid}\n999999999\n")
        assert haproxy_pids(str(files)) == [ours.pid]
        assert stop_haproxy(str(files)) == [ours.pid]
        assert ours.wait(timeout=10) == -9 and other.poll() is None
        assert haproxy_pids(str(files)) == []
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


def test_the_watcher_stops_what_a_dead_driver_left(tmp_path):
    """The driver's end of the pipe closes without a release (here by hand; in a crash, by the
    kernel): the watcher SIGKILLs every process still holding a file under the session dir but
    the driver's, and removes `remove`; after a release it touches nothing."""
    import os
    import subprocess
    import sys
    import time

    from workflows.reaper import release, session_pids, watch_session

    session, own = tmp_path / "session_x", tmp_path / "mfh-own"
    (session / "logs").mkdir(parents=True)
    own.mkdir()
    hold = "import sys, time; f = open(sys.argv[1], 'a'); time.sleep(120)"
    agent = subprocess.Popen([sys.executable, "-c", hold, str(session / "logs" / "agent.log")],
                             start_new_session=True)  # like Ray's agents: parent gone, its own group
    bystander = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "other.log")])
    try:
        deadline = time.monotonic() + 30
        while not session_pids(str(session)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_pids(str(session)) == [agent.pid]
        with open(session / "logs" / "driver.log", "a"):  # like Ray's driver: spared
            released = watch_session(str(session), str(own))
            assert released is not None
            release(released)  # a clean stop: the watcher leaves at once
            time.sleep(2.0)
            assert agent.poll() is None and own.exists()
            fd = watch_session(str(session), str(own))
            assert fd is not None
            time.sleep(1.0)
            assert agent.poll() is None  # the driver still lives: nothing is touched
            os.close(fd)
            assert agent.wait(timeout=30) == -9
        deadline = time.monotonic() + 30
        while own.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not own.exists() and bystander.poll() is None
    finally:
        for p in (agent, bystander):
            p.kill()
            p.wait()
