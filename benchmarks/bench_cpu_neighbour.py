"""Does a busy neighbour on the other CPU slow `generate` down on this host? In one run.

    .venv/bin/python benchmarks/bench_cpu_neighbour.py [--rounds 7] [--repeat 2]

A served round shares the host's CPUs between the engine core and the replica, HAProxy, the
client and Ray (benchmarks/bench_served_wall.py). If the CPUs slowed each other down (shared
caches, memory bandwidth, SMT siblings) the core's steps would cost more beside them than
alone. This times `generate` on the demo model (16 prompts x 32 random tokens, 32 new, greedy,
one torch thread; the calling thread's CPU clock and the wall) alone and beside a process that
keeps the other CPU busy: a Python spin loop, a one-thread 512x512 float32 matmul loop, a scan
of 64 MB of memory. Prints the median per round of each, and its ratio to alone.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from engine_rates import prompts  # noqa: E402

NEIGHBOURS = {
    "alone": None,
    "python spin loop": "while True: pass",
    "torch matmul loop": "import torch; torch.set_num_threads(1); a = torch.randn(512, 512)\nwhile True: a @ a",
    "64 MB memory scan": "import numpy as np; a = np.ones(64 << 20, dtype=np.uint8)\nwhile True: a.sum()",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / "assets" / "demo-base"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()

    from bench_engine import generate_tps

    from moeflow.model.models import load_model

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = load_model(args.model, torch.float32).eval()
    batch = prompts(16, 32, model.config.vocab_size, 0)
    generate_tps(model, batch, 32)  # warm-up
    seen: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.repeat):
        for name, code in NEIGHBOURS.items():
            proc = subprocess.Popen([sys.executable, "-c", code]) if code else None
            try:
                time.sleep(0.5)  # the neighbour up and busy
                for _ in range(args.rounds):
                    c0, t0 = time.thread_time(), time.perf_counter()
                    generate_tps(model, batch, 32)
                    seen.setdefault(name, []).append((time.thread_time() - c0, time.perf_counter() - t0))
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    cpu0 = statistics.median(c for c, _ in seen["alone"])
    print(f"generate, 16 x 32 in / 32 out, one thread; medians of {args.rounds * args.repeat} rounds (ms)")
    for name, rows in seen.items():
        cpu, wall = statistics.median(c for c, _ in rows), statistics.median(w for _, w in rows)
        print(f"  {name:20s} cpu {1e3 * cpu:6.1f}  wall {1e3 * wall:6.1f}  cpu / alone {cpu / cpu0:5.2f}")


if __name__ == "__main__":
    main()
