"""The dry run's host probe alone and beside CPU-bound processes: what it reads of the host.

    .venv/bin/python benchmarks/bench_probe.py              # 2 busy processes (one per core here)
    .venv/bin/python benchmarks/bench_probe.py --busy 4

`moeflow.parallel.estimate.probe_host` (the calling thread's CPU time, torch on one thread) against the
same mix timed by the wall clock with torch on its default threads (how it was timed before
2026-12-06), each the median of 5 rounds, first alone, then beside `--busy` processes that
spin a core each. Reported: both readings and their ratio busy / alone. A probe that reads
the core's speed stays near 1; one that reads contention grows with the busy processes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def wall_probe(repeats: int = 5) -> float:
    """The probe's mix by the wall clock on torch's default threads (the probe before)."""
    from moeflow.parallel.pricing import probe_work

    def once() -> float:
        t = time.perf_counter()
        probe_work()
        return time.perf_counter() - t

    once()
    times = sorted(once() for _ in range(repeats))
    return times[len(times) // 2]


def readings() -> dict[str, float]:
    from moeflow.parallel.estimate import probe_host

    return {"probe_host (CPU time, 1 thread)": probe_host(), "wall clock, default threads": wall_probe()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the probe")
    args = ap.parse_args()
    alone = readings()
    stop = mp.Event()
    hogs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for h in hogs:
        h.start()
    try:
        time.sleep(0.5)
        busy = readings()
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
    for name in alone:
        print(f"{name:32} alone {alone[name]:.4f} s   beside {args.busy} busy {busy[name]:.4f} s   "
              f"ratio {busy[name] / alone[name]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
