"""A replica's compile warm-up (`deploy.compile: true`), cold and warm, on the demo model.

    .venv/bin/python benchmarks/bench_compile_warmup.py              # one cold + warm pair
    .venv/bin/python benchmarks/bench_compile_warmup.py --repeat 2

With `deploy.compile` a replica's engine core compiles its forwards (`EngineCore.warm_up`: one
synthetic round per kind of forward) before it reports ready; the dry run prices that as
`COMPILE_WARMUP_S` (moeflow/parallel/estimate_constants.py). This benchmark builds the engine
core as the core process of a replica does (`moeflow/serving/core.py`: `load_served`, the
expert-load hooks, `EngineConfig` from `configs/demo.yaml`'s `deploy:` with `compile: true`, the
replica's torch threads) and times `warm_up()`:

- cold: a fresh process with an empty Inductor cache (`TORCHINDUCTOR_CACHE_DIR` a new temp
  dir): what the first replica on a fresh node pays, and what the dry run prices;
- warm: another fresh process over the same cache dir (Inductor's FX graph and compiled C++
  found on disk; Dynamo still traces): what a restarted replica on the same node pays.

Each side is timed by the wall clock and by CPU seconds (the process and its Inductor compile
workers and compiler runs, from /proc via psutil: the part other sessions' load on a shared host
does not inflate). Around each warm-up the process reads the dry run's own host probe
(`probe_host`, before and after, averaged); its factor against `ANCHOR_PROBE_S` turns the CPU
seconds into the anchor host's seconds, the unit of the constant (a dry run on `cpu-local`
multiplies them by its own probe's factor again). On a loaded host the wall clock also counts
other sessions' turns on the cores; the CPU seconds do not. Load averages are printed beside
each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def tree_cpu_s() -> float:
    """CPU seconds of this process and every descendant alive now, each with its reaped children
    (Inductor's compile workers and the C++ compiler runs they wait for)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:  # exited between the listing and the read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def child(model: str, config: str) -> None:
    """One warm-up in this process (the cache dir comes from the environment); JSON on the last line."""
    import torch
    from torch._dynamo.utils import counters

    from moeflow.core.config import load_config
    from moeflow.serving.adapters import AdapterRegistry
    from moeflow.serving.core import load_served
    from moeflow.serving.deployment import engine_settings
    from moeflow.serving.engine_core import EngineCore
    from moeflow.serving.metrics import ExpertLoad
    from moeflow.serving.scheduler import EngineConfig
    from moeflow.serving.settings import ServeSettings

    cfg = load_config(config, ["deploy.compile=true"])
    settings = ServeSettings(base_dir=model, served_model_name="demo", dtype=cfg.deploy.dtype,
                             engine=engine_settings(cfg) | {"compile": True},
                             torch_threads=max(1, int(cfg.deploy.num_cpus)))
    torch.set_num_threads(settings.torch_threads)  # as the core process (core.py _Core)
    model_ = load_served(settings, {})
    experts = ExpertLoad(model_, settings.expert_window_steps, settings.expert_balance_threshold)
    engine = EngineCore(model_, EngineConfig(**settings.engine), AdapterRegistry(), experts, emit=lambda _: None)
    from moeflow.parallel.pricing import probe_host

    load0, probe0 = os.getloadavg()[0], probe_host()
    t0, c0 = time.perf_counter(), tree_cpu_s()
    engine.warm_up()
    wall, cpu = time.perf_counter() - t0, tree_cpu_s() - c0
    probe = (probe0 + probe_host()) / 2  # the core's speed around the warm-up, by the same clock
    if engine.runner.compiled is None:
        sys.exit("bench_compile_warmup: the warm-up fell back to eager (compiling failed; the engine's log says why)")
    print(json.dumps({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "probe_s": round(probe, 4),
                      "graphs": counters["stats"]["unique_graphs"],
                      "load": [round(load0, 1), round(os.getloadavg()[0], 1)]}))


def run_child(args, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=str(Path(cache) / "triton"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, __file__, "--model", args.model, "--config", args.config, "--child"],
                         env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)  # the config's paths
    if out.returncode:
        sys.exit(out.returncode)  # the child said why on stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / "assets" / "demo-base"))
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="its deploy: knobs, compile on")
    p.add_argument("--repeat", type=int, default=1, help="cold + warm pairs, each over a new cache dir")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        from moeflow.core.errors import UserError

        try:
            child(args.model, args.config)
        except UserError as exc:  # a config or model that does not load: one line
            sys.exit(f"bench_compile_warmup: {exc}")
        return
    for what, path in (("--model", args.model), ("--config", args.config)):
        if not Path(path).exists():
            sys.exit(f"bench_compile_warmup: {what} {path} does not exist")

    from moeflow.parallel.estimate import ANCHOR_PROBE_S, COMPILE_WARMUP_S

    rows = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="mf-inductor-") as cache:
            cold = run_child(args, cache)
            warm = run_child(args, cache)
        rows.append((cold, warm))
        for name, r in (("cold", cold), ("warm", warm)):
            r["host_factor"] = round(r["probe_s"] / ANCHOR_PROBE_S, 3)
            r["anchor_s"] = round(r["cpu_s"] / r["host_factor"], 1)
            print(f"run {i + 1} {name}: {r['wall_s']:7.1f} s wall, {r['cpu_s']:7.1f} CPU s, probe "
                  f"x{r['host_factor']:.2f} the anchor host's -> {r['anchor_s']:6.1f} s there; "
                  f"{r['graphs']} graphs; load {r['load'][0]}-{r['load'][1]}", flush=True)
    med = {k: {s: statistics.median(r[j][s] for r in rows) for s in ("wall_s", "cpu_s", "anchor_s")}
           for j, k in enumerate(("cold", "warm"))}
    print(f"median of {args.repeat}: cold {med['cold']['wall_s']:.1f} s wall / {med['cold']['cpu_s']:.1f} CPU s, "
          f"warm {med['warm']['wall_s']:.1f} s wall / {med['warm']['cpu_s']:.1f} CPU s; warm / cold by CPU "
          f"{med['warm']['cpu_s'] / med['cold']['cpu_s']:.2f}x")
    print(f"on the anchor host (CPU s / the probe's factor; ANCHOR_PROBE_S {ANCHOR_PROBE_S} s): cold "
          f"{med['cold']['anchor_s']:.1f} s, warm {med['warm']['anchor_s']:.1f} s; COMPILE_WARMUP_S ships "
          f"{COMPILE_WARMUP_S:g} s")
    print(json.dumps({"runs": [{"cold": c, "warm": w} for c, w in rows]}))


if __name__ == "__main__":
    main()
