"""The engine core's per-step timing, for benchmarks and for finding where a step's time goes.

`MOEFLOW_STEP_LOG=PATH` in the environment of a process that runs an engine core (the core
process inherits it from its replica, and a replica from the Ray it was started under) appends
one tab-separated line per step to `PATH.<pid>`: the step's start on the host's monotonic clock
(time.perf_counter: CLOCK_MONOTONIC, comparable between processes of one host), the rows and
tokens it ran, its wall and CPU time (queued messages taken, scheduling, forward, sampling) and
the time its output took to emit (the core process: pickled and written to the replica). Unset,
the core spends four clock reads a step on it (about a microsecond). benchmarks/bench_served_wall.py reads it.
Written here because neither torch's profiler nor Prometheus' metrics time a step as a whole
with its composition at this cost.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "MOEFLOW_STEP_LOG"
FIELDS = ("start_s", "rows", "tokens", "step_ms", "step_cpu_ms", "emit_ms")


class StepLog:
    """An open step log (line-buffered: a reader sees every finished step)."""

    def __init__(self, path: str):
        self.file = open(f"{path}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115  # the core's lifetime

    @classmethod
    def from_env(cls) -> "StepLog | None":
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def write(self, start: float, rows: int, tokens: int, step_s: float, step_cpu_s: float, emit_s: float) -> None:
        self.file.write(f"{start:.6f}\t{rows}\t{tokens}\t{1e3 * step_s:.3f}\t{1e3 * step_cpu_s:.3f}\t"
                        f"{1e3 * emit_s:.3f}\n")


def read(path: str | Path) -> list[dict[str, float]]:
    """Every step logged under `path` (all processes), in start order."""
    path = Path(path)
    rows = []
    for f in path.parent.glob(f"{path.name}.*"):
        for line in f.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == len(FIELDS):
                rows.append(dict(zip(FIELDS, map(float, parts))))
    return sorted(rows, key=lambda r: r["start_s"])
