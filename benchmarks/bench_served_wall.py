"""Where a served round's wall clock goes: each process's CPU and run-queue wait, in one run.

    .venv/bin/python benchmarks/bench_served_wall.py [--rounds 9] [--output-len 32]

bench_served_cpu.py counts the CPU a served round spends against `generate`'s; on a quiet host
the served stack spends about 1.24x `generate`'s CPU and yet streams at about 0.66x its tokens/s
(docs/serving.md). This benchmark splits the served round's wall instead. It serves the demo model
as bench_engine.py's HTTP row does (Ray Serve, the default ingress, the engine core in its own
process, stream interval 8, 16 streams of `--input-len` random tokens in, exactly
`--output-len` out, one HTTP client with its connections kept alive) and alternates each served
round with `generate` on the same prompts as one batch, in this process. Around every round it
reads every thread's /proc/PID/task/TID/schedstat (Linux: nanoseconds on a CPU, nanoseconds
runnable but waiting for one) and groups the processes:

- core: the engine core process (the replica's child), and its main thread on its own;
- replica: the Serve replica (its event loop, its reader thread);
- haproxy: the ingress;
- client: this process (the HTTP client's event loop; `generate` in its rounds);
- ray: every other process of this Ray session (raylet, GCS, the controller, the proxy);
- other: everything else on the host (other sessions' work: a quiet host shows little).

Per group it prints the median CPU and run-queue wait per round in ms, and for the core's main
thread the round's wall split into on-CPU, runnable-but-waiting and sleeping (blocked on its
socket: nothing to do). The core logs each step (MOEFLOW_STEP_LOG, moeflow/serving/step_log.py),
from which it prints per round: the steps, when the last request reached a step (the arrivals'
spread), a full decode step's time and CPU, the time from one step's start to the next, and the
emit of a step's output. The client records when it sent each request (loadgen's `Result.sent`),
so the round also shows how far apart the requests left the client and when their first tokens
came back.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_rates import Client, deploy_demo, eager_anchor, http_tps, local_serve, served_round_parser  # noqa: E402

from moeflow.serving.traffic import Request  # noqa: E402


def snapshot() -> dict[int, dict]:
    """Every process on the host: parent, name, and per thread (cpu ns, wait ns)."""
    out: dict[int, dict] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        threads = {}
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        run, wait, _ = f.read().split()
                    threads[int(tid)] = (int(run), int(wait))
                except (OSError, ValueError):
                    continue
        except OSError:
            continue
        out[pid] = {"ppid": int(rest.split()[1]), "comm": head.split("(", 1)[1], "cmd": cmd, "threads": threads}
    return out


def descendants(procs: dict[int, dict], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, p in procs.items():
        children.setdefault(p["ppid"], []).append(pid)
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen


def groups(procs: dict[int, dict], ray_root: int) -> dict[str, set[int]]:
    """The processes of each group (see the module docstring)."""
    replica = {pid for pid, p in procs.items() if "ServeReplica" in p["cmd"]}
    core: set[int] = set()
    for pid in replica:
        core |= descendants(procs, pid) - {pid}
    haproxy = {pid for pid, p in procs.items() if "haproxy" in p["comm"].lower()}
    client = {os.getpid()}
    ray = descendants(procs, ray_root) - replica - core - haproxy - client
    other = set(procs) - replica - core - haproxy - client - ray
    return {"core": core, "replica": replica, "haproxy": haproxy, "client": client, "ray": ray, "other": other}


def label(proc: dict) -> str:
    """A short name for one of Ray's processes: a worker by what it runs, else its command's name."""
    cmd = proc["cmd"]
    for key in ("ServeController", "ProxyActor", "ExpertLoadBook", "AdapterBook", "dashboard_agent",
                "runtime_env_agent", "log_monitor", "monitor.py", "gcs_server", "raylet"):
        if key in cmd:
            return key
    return cmd.split()[0].rsplit("/", 1)[-1][:30] if cmd else proc["comm"]


def delta(before: dict, after: dict, pids: set[int], main_only: bool = False) -> tuple[float, float]:
    """CPU and run-queue wait (seconds) of `pids` between two snapshots (threads alive in both,
    or born between them)."""
    run = wait = 0
    for pid in pids:
        threads = after.get(pid, {}).get("threads", {})
        old = before.get(pid, {}).get("threads", {})
        for tid, (r, w) in threads.items():
            if main_only and tid != pid:
                continue
            r0, w0 = old.get(tid, (0, 0))
            run, wait = run + r - r0, wait + w - w0
    return run / 1e9, wait / 1e9


def main() -> None:
    args = served_round_parser(__doc__, rounds=9).parse_args()

    import httpx
    from bench_engine import generate_tps

    anchor, batch = eager_anchor(args)
    new = args.output_len
    temp = tempfile.mkdtemp(prefix="/tmp/mfwall")
    client = Client(len(batch) + 4)
    from moeflow.serving import step_log

    os.environ[step_log.ENV] = log = f"{temp}/steps"  # the core process inherits it through Ray
    with local_serve(temp) as port:
        try:
            deploy_demo(args, "wall")
            url = f"http://127.0.0.1:{port}/wall"
            httpx.get(f"{url}/v1/models", timeout=600).raise_for_status()
            for _ in range(2):  # warm both sides
                http_tps(client, url, batch, new)
                generate_tps(anchor, batch, new)
            # Ray was started by this process: GCS, raylet and workers are all its descendants
            ray_root = os.getpid()
            rows: dict[str, list[float]] = {}

            def add(key: str, value: float) -> None:
                rows.setdefault(key, []).append(value)
            for _ in range(args.rounds):
                s0 = snapshot()
                t0 = time.perf_counter()
                generate_tps(anchor, batch, new)
                add("generate wall", time.perf_counter() - t0)
                s1 = snapshot()
                add("generate cpu", delta(s0, s1, {os.getpid()})[0])
                s0 = snapshot()
                t0 = time.perf_counter()
                results, replay_s = client.replay(url, [Request(arrival_s=0.0, model="demo", prompt=q, max_tokens=new,
                                                                klass="random") for q in batch])
                wall = time.perf_counter() - t0  # the round as the snapshots bracket it
                if not all(r.ok for r in results):
                    raise RuntimeError(f"HTTP requests failed: {[r.error for r in results if not r.ok][:2]}")
                tps = sum(r.output_tokens for r in results) / replay_s  # as bench_engine's http_tps
                sent = sorted(r.sent - t0 for r in results if r.sent is not None)
                firsts = sorted(r.sent + r.ttft - t0 for r in results if r.sent is not None)
                add("client sent first", sent[0])
                add("client sent last", sent[-1])
                add("first token first", firsts[0])
                add("first token last", firsts[-1])
                s1 = snapshot()
                add("served wall", wall)
                add("served tok/s", tps)
                for name, pids in groups(s1, ray_root).items():
                    cpu, wait = delta(s0, s1, pids)
                    add(f"{name} cpu", cpu)
                    add(f"{name} wait", wait)
                    if name == "ray":  # which of Ray's own processes spend it
                        by: dict[str, float] = {}
                        for pid in pids:
                            by[label(s1[pid])] = by.get(label(s1[pid]), 0.0) + delta(s0, s1, {pid})[0]
                        for key, cpu in by.items():
                            add(f"ray: {key}", cpu)
                steps = [r for r in step_log.read(log) if t0 <= r["start_s"] <= t0 + wall]
                full = [r for r in steps if r["rows"] == r["tokens"] == args.num_prompts]
                if steps and full:
                    add("core steps", len(steps))
                    add("all arrived", next(r["start_s"] for r in steps if r["rows"] == args.num_prompts) - t0)
                    add("first step", steps[0]["start_s"] - t0)
                    add("last step end", t0 + wall - steps[-1]["start_s"] - steps[-1]["step_ms"] / 1e3)
                    add("decode step", statistics.median(r["step_ms"] for r in full) / 1e3)
                    add("decode step cpu", statistics.median(r["step_cpu_ms"] for r in full) / 1e3)
                    add("emit", statistics.median(r["emit_ms"] for r in steps) / 1e3)
                    add("step to step", statistics.median(b["start_s"] - a["start_s"]
                                                          for a, b in zip(steps, steps[1:])))
                cpu, wait = delta(s0, s1, groups(s1, ray_root)["core"], main_only=True)
                add("core main cpu", cpu)
                add("core main wait", wait)
                add("core main asleep", wall - cpu - wait)
            med = {k: statistics.median(v) for k, v in rows.items()}
            gen = med["generate wall"]
            print(f"{args.rounds} alternated rounds, {args.num_prompts} streams x {args.input_len} in / {new} out, "
                  f"interval {args.stream_interval}; medians per round (ms; ratio to generate's wall)")
            for key in ("generate wall", "generate cpu", "served wall"):
                print(f"  {key:22s} {1e3 * med[key]:8.1f}   {med[key] / gen:5.2f}")
            print(f"  served / generate tok/s: {args.num_prompts * new / gen / 1:.0f} generate, "
                  f"{med['served tok/s']:.0f} served ({med['served tok/s'] * gen / (args.num_prompts * new):.2f})")
            for name in ("core", "replica", "haproxy", "client", "ray", "other"):
                print(f"  {name:8s} cpu {1e3 * med[f'{name} cpu']:7.1f}  "
                      f"run-queue wait {1e3 * med[f'{name} wait']:7.1f}")
            ray_top = sorted(((statistics.median(v + [0.0] * (args.rounds - len(v))), k[5:])  # absent: 0
                              for k, v in rows.items() if k.startswith("ray: ")), reverse=True)[:5]
            print("  ray's largest (median cpu ms per round): "
                  + ", ".join(f"{name} {1e3 * cpu:.1f}" for cpu, name in ray_top))
            if "core steps" in med:
                print(f"  core steps per round {med['core steps']:.0f}; first step {1e3 * med['first step']:.1f} ms "
                      f"into the round, the last request in a step at {1e3 * med['all arrived']:.1f} ms, from the "
                      f"last step's end to the round's {1e3 * med['last step end']:.1f} ms")
                print(f"  a full decode step ({args.num_prompts} rows): {1e3 * med['decode step']:.2f} ms "
                      f"({1e3 * med['decode step cpu']:.2f} ms CPU), step start to step start "
                      f"{1e3 * med['step to step']:.2f} ms, emit {1e3 * med['emit']:.2f} ms; generate's wall per "
                      f"token {1e3 * gen / new:.2f} ms")
            print(f"  the client sent its requests {1e3 * med['client sent first']:.1f}-"
                  f"{1e3 * med['client sent last']:.1f} ms into the round; their first tokens reached it "
                  f"{1e3 * med['first token first']:.1f}-{1e3 * med['first token last']:.1f} ms into it")
            print(f"  core main thread: on cpu {1e3 * med['core main cpu']:.1f}, waiting for a cpu "
                  f"{1e3 * med['core main wait']:.1f}, asleep {1e3 * med['core main asleep']:.1f} of the served wall")
        finally:
            client.close()


if __name__ == "__main__":
    main()
