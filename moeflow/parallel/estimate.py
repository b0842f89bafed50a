"""Per-stage time, memory, bytes and cost of a pipeline before it runs (`moeflow run --dry-run`).

Beside the planner: the planner picks the parallel plan and prices one training step or one
decode step; this module prices every stage of the DAG on the same hardware spec with the same
cost model (moeflow/parallel/cost.py) and says, for each figure, what it rests on (the bases:
moeflow/parallel/pricing.py). The stages: moeflow/parallel/stage_prices.py (convert, plan,
operators, finetune, calibrate, regress) and serving_prices.py (serving, deploy); the checks:
moeflow/parallel/checks.py.

The pipeline's wall time is its critical path through the DAG (finetune and calibrate run
side by side) plus PIPELINE_START_S; device-hours are each stage's devices x its time; "booked"
is the whole cluster for the whole wall time. Cost = device-hours x price_per_device_hour.

    python -c "from moeflow.parallel.estimate import *"   # `moeflow run CONFIG --dry-run` is the CLI
"""

from __future__ import annotations

from moeflow.parallel.checks import checks
from moeflow.parallel.estimate_constants import ANCHOR_PROBE_S
from moeflow.parallel.pricing import (
    ANCHOR_HOST,
    COMPILE_WARMUP_S,
    CORE_START_S,
    PIPELINE_START_S,
    PROCESS_START_S,
    Check,
    Inputs,
    PipelineEstimate,
    Rates,
    StageEstimate,
    Term,
    probe_host,
)
from moeflow.parallel.serving_prices import deploy, serving
from moeflow.parallel.stage_prices import calibrate, convert, finetune, operators, plan, regress

# the dry run's public names, wherever they are defined (callers import them from here)
__all__ = ["ANCHOR_HOST", "ANCHOR_PROBE_S", "COMPILE_WARMUP_S", "CORE_START_S", "PIPELINE_START_S",
           "PROCESS_START_S", "Check", "Inputs", "PipelineEstimate", "Rates", "StageEstimate", "Term",
           "probe_host", "ESTIMATORS", "estimate", "critical_path", "checks", "convert", "plan",
           "operators", "finetune", "calibrate", "regress", "serving", "deploy"]

ESTIMATORS = {"convert": convert, "plan": plan, "operators": operators, "finetune": finetune,
              "calibrate": calibrate, "regress": regress, "serving": serving, "deploy": deploy}


def estimate(inp: Inputs) -> PipelineEstimate:
    """Every enabled stage, the critical path, and the checks.

    Returns:
        PipelineEstimate: stages in DAG order; a stage without a model here (a plugin) has no
        terms and says so.
    """
    r = Rates(inp)
    stages = []
    for name, spec in inp.stage_specs.items():
        fn = ESTIMATORS.get(name)
        st = fn(inp, r) if fn else StageEstimate(name, "plugin stage", 0, 1, 0.0, 0.0, 0.0,
                                                 notes=["no estimate model for this stage"])
        st.upstream = tuple(u for u in spec.upstream if u in inp.stage_specs)
        st.after = tuple(u for u in spec.after if u in inp.stage_specs)
        stages.append(st)
    path, wall = critical_path(stages)
    price = (inp.cfg.estimate.price_per_device_hour if inp.cfg.estimate.price_per_device_hour
             is not None else inp.hw.price_per_device_hour)
    est = PipelineEstimate(stages, [], path, wall + PIPELINE_START_S * r.host, inp.hw.world_size, price,
                           assumptions=_assumptions(r, price, inp), host=r.host)
    est.checks = checks(inp, est)
    return est


def critical_path(stages: list[StageEstimate]) -> tuple[list[str], float]:
    """The longest chain of stages through the DAG and its length in seconds: a stage starts
    when its upstream and the `after` stages of the run have finished (the runner's order)."""
    finish: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for s in stages:  # DAG order: upstream first
        ups = [u for u in (*s.upstream, *s.after) if u in finish]
        prev = max(ups, key=lambda u: finish[u]) if ups else None
        finish[s.name] = (finish[prev] if prev else 0.0) + s.seconds
        via[s.name] = prev
    if not finish:
        return [], 0.0
    end = max(finish, key=lambda k: finish[k])
    path = [end]
    while prev := via[path[-1]]:
        path.append(prev)
    return path[::-1], finish[end]


def _assumptions(r: Rates, price: float | None, inp: Inputs) -> dict[str, str]:
    return {"mfu": f"{r.mfu:g} ({r.mfu_basis})", "storage_read": f"{r.read:g} GB/s ({r.read_basis})",
            "storage_write": f"{r.write:g} GB/s ({r.write_basis})",
            "process_start": f"{r.start:g} s ({r.start_basis})",
            "host_speed": (f"x{r.host:.3f}: probe {inp.host_probe_s:.4f} s here vs {ANCHOR_PROBE_S} s "
                           f"on {ANCHOR_HOST}'s anchor") if r.host != 1.0 else
                          "x1 (host costs as measured on the anchor)",
            "price_per_device_hour": "not set (hardware spec or estimate.price_per_device_hour)"
            if price is None else f"{price:g}",
            "checkpoint_bytes": inp.src_basis, "storage_free": inp.storage_free[1]}
