"""The dry run's host probe reads the core's speed, not how many processes share it."""

from __future__ import annotations

import multiprocessing as mp
import time

from benchmarks.bench_probe import _spin
from moeflow.parallel.estimate import probe_host


def test_the_probe_reads_the_same_beside_processes_that_take_every_core():
    """Three processes spinning on this host's cores slow a wall-clock probe several-fold
    (benchmarks/bench_probe.py); the probe's CPU time on its one thread stays."""
    alone = probe_host()
    stop = mp.get_context("spawn").Event()
    hogs = [mp.get_context("spawn").Process(target=_spin, args=(stop,), daemon=True) for _ in range(3)]
    for h in hogs:
        h.start()
    try:
        time.sleep(1.0)  # spawned interpreters started and spinning
        busy = probe_host()
    finally:
        stop.set()
        for h in hogs:
            h.join(10)
    assert 0 < busy < 1.3 * alone, (alone, busy)
