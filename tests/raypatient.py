"""`ray start` / `ray.init` with a longer node start-up limit, for tests and benchmarks on a
loaded host.

Ray gives a starting node a fixed 30 s to register its raylet (a literal in
`ray/_private/node.py`, no setting), which a 2-core host running several sessions often
misses. This wrapper runs Ray's own code with that module's clock slowed by
MOEFLOW_RAY_PATIENCE (default 6: the limit becomes 3 minutes); nothing else changes.

    python -m tests.raypatient start --head --port 6379 ...    # = ray start ...
    from tests.raypatient import patient; patient()            # before ray.init in-process

The raylet side has its own waits (for the dashboard agent's port file, for agents to
register); `PATIENT_ENV` lengthens those through Ray's documented RAY_* config variables:
put it in the environment of `ray start`.
"""

from __future__ import annotations

import os
import sys
import time as _time


PATIENT_ENV = {"RAY_raylet_start_wait_time_s": "300", "RAY_agent_register_timeout_ms": "300000"}


class _SlowClock:
    def __init__(self, factor: float):
        self.factor = factor

    def monotonic(self) -> float:
        return _time.monotonic() / self.factor

    def __getattr__(self, name):
        return getattr(_time, name)


def patient(factor: float | None = None) -> None:
    import ray._private.node as node
    import ray._private.utils as utils

    node.time = _SlowClock(factor or float(os.environ.get("MOEFLOW_RAY_PATIENCE", "6")))
    # the raylet waits ~15 s (no setting) for the dashboard agent's port file; the full agent
    # imports the dashboard modules first, which a loaded host does not do in time. Its
    # minimal mode (what a `ray` install without `[default]` runs) starts in a fraction of that;
    # moeflow's tests and benchmarks use neither the dashboard nor its agent modules.
    utils.get_dashboard_dependency_error = lambda: "moeflow tests: minimal dashboard agent"


if __name__ == "__main__":
    patient()
    from ray.scripts.scripts import main

    sys.argv = ["ray", *sys.argv[1:]]
    main()
