"""Stop benchmark: SIGTERM to `moeflow serve` (HAProxy ingress), at random moments of its start
(while Serve reloads HAProxy as the replica comes up) and once it serves, N times.

    nice .venv/bin/python benchmarks/bench_stop.py --repeats 10
    nice .venv/bin/python benchmarks/bench_stop.py --repeats 3 --group   # kill the process group
    nice .venv/bin/python benchmarks/bench_stop.py --repeats 3 --crash   # SIGKILL the driver alone
    nice .venv/bin/python benchmarks/bench_stop.py --repeats 4 --engine-process false  # in-process engines

After each stop it checks, and the run passes only if every stop is clean:
- `moeflow serve` exited (0 once serving; 130 when stopped during start-up);
- no HAProxy it started runs (its pid file) and nothing listens on the API port;
- no process of its Ray session is left (a process holding a file under the session dir).
With --crash the driver is SIGKILLed instead (nothing of it runs any cleanup): what it started
must still go, by Ray's fate-sharing and HAProxy's parent-death signal, within 30 s.
Prints one line per stop (seconds from SIGTERM to exit) and a JSON summary.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def api_port(hap: str) -> int | None:
    """The API frontend's port from the config the wrapper handed HAProxy."""
    for path in glob.glob(os.path.join(hap, "*", "haproxy.cfg.moeflow")):
        for line in Path(path).read_text().splitlines():
            parts = line.split()
            if parts[:1] == ["bind"] and not parts[1].startswith("fd@") and ":" in parts[1]:
                return int(parts[1].rsplit(":", 1)[1])
    return None


def one_stop(config: Path, work: Path, when: str, group: bool, start_timeout: float = 240.0,
             crash: bool = False) -> dict:
    """Start `moeflow serve`, SIGTERM it `when` ('serving' or 'start-up'), check what is left."""
    from moeflow.serving.ingress import PIDS_NAME, haproxy_pids
    from workflows.reaper import session_pids

    ray_tmp = tempfile.mkdtemp(prefix="/tmp/mfr")
    hap_tmp = tempfile.mkdtemp(prefix="/tmp/mfh-")  # this server's HAProxy dir, not another's on the host
    env = dict(os.environ, PYTHONPATH=str(REPO), MOEFLOW_RAY_TEMP_DIR=ray_tmp, MOEFLOW_HAPROXY_DIR=hap_tmp)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "workflows.cli", "serve", str(config), "--ingress", "haproxy"],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    hap, seen, port = None, set(), None
    deadline, fire_at, out = time.monotonic() + start_timeout, None, ""
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            out = "".join(lines)
            hap = hap or (os.path.join(hap_tmp, "hap") if os.path.isdir(os.path.join(hap_tmp, "hap")) else None)
            if hap:
                seen |= set(haproxy_pids(hap))
                port = port or api_port(hap)
            if when == "start-up" and seen and fire_at is None:
                fire_at = time.monotonic() + random.uniform(0.0, 6.0)  # somewhere among the reloads
            if (fire_at and time.monotonic() >= fire_at) or "serving in the foreground" in out:
                break
            time.sleep(0.05)
        if proc.poll() is not None:
            return {"ok": False, "why": f"exited {proc.returncode} before the SIGTERM", "out": out[-2000:]}
        if time.monotonic() >= deadline:
            return {"ok": False, "why": "did not start in time", "out": out[-2000:]}
        sessions = glob.glob(os.path.join(ray_tmp, "session_2*"))
        reloads = len(Path(hap, PIDS_NAME).read_text().split()) if hap and os.path.exists(
            os.path.join(hap, PIDS_NAME)) else 0
        t0 = time.monotonic()
        if crash:
            proc.send_signal(signal.SIGKILL)
        elif group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        took = time.monotonic() - t0
        settle = time.monotonic() + (30 if crash else 0)  # a crash: the OS and Ray reap, not moeflow
        while crash and time.monotonic() < settle and (
                any(Path(f"/proc/{p}").exists() and _not_zombie(p) for p in seen)
                or any(session_pids(s) for s in sessions) or (port and listening(port))):
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(0.2)  # the reader thread's last lines
    out = "".join(lines)
    left_hap = [p for p in seen if Path(f"/proc/{p}").exists() and _not_zombie(p)]
    left_session = [p for s in sessions for p in session_pids(s)]
    bound = bool(port) and listening(port)
    # 0: stopped while serving; 130: during start-up; -15: SIGTERM before moeflow took over from
    # Python's default (inside ray.init), when nothing of ours runs yet
    ok = not left_hap and not left_session and not bound and proc.returncode in (0, 130, 143, -15, -9)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    shutil.rmtree(hap_tmp, ignore_errors=True)
    return {"ok": ok, "when": when, "seconds": round(took, 2), "exit": proc.returncode,
            "haproxy_started": reloads, "haproxy_left": left_hap, "session_left": left_session,
            "port": port, "port_bound": bound, **({} if ok else {"out": out[-3000:]})}


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--group", action="store_true", help="SIGTERM the whole process group (systemd, k8s)")
    ap.add_argument("--crash", action="store_true", help="SIGKILL the driver (a crash): no cleanup of its own")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-process", choices=["auto", "true", "false"], default="auto",
                    help="deploy.engine_process (auto, the default: the core process for this text model)")
    args = ap.parse_args()
    random.seed(args.seed)
    import yaml

    from moeflow_testing.tiny import build_debug_model

    work = Path(tempfile.mkdtemp(prefix="moeflow-stop-"))
    try:
        base = build_debug_model("qwen3_moe", work / "m")
        config = work / "serve.yaml"
        config.write_text(yaml.safe_dump({"name": "stop", "model": {"path": str(base)},
                                          "deploy": {"num_replicas": 1, "port": 0,
                                                     "engine_process": {"auto": "auto", "true": True,
                                                                        "false": False}[args.engine_process]}}))
        results = []
        for i in range(args.repeats):
            when = "start-up" if i % 2 == 0 else "serving"
            res = one_stop(config, work, when, args.group, crash=args.crash)
            results.append(res)
            print(f"stop {i + 1}/{args.repeats} ({res.get('when', when)}): "
                  + ("clean" if res["ok"] else "NOT CLEAN") + f" in {res.get('seconds', '-')} s"
                  + f", exit {res.get('exit')}, {res.get('haproxy_started', 0)} HAProxy start(s)", flush=True)
            if not res["ok"]:
                print(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    clean = sum(r["ok"] for r in results)
    secs = [r["seconds"] for r in results if "seconds" in r]
    print(json.dumps({"repeats": args.repeats, "clean": clean, "group": args.group,
                      "max_stop_s": max(secs, default=None),
                      "mean_stop_s": round(sum(secs) / len(secs), 2) if secs else None}))
    return 0 if clean == args.repeats else 1


if __name__ == "__main__":
    sys.exit(main())
