"""Activation remedies of a LoRA plan whose activations do not fit a device, in the order the
planner tries them: the plan as given, per-layer recompute (one more forward), then recompute
and context parallelism CP = 2, 4, ... (CP divides DP); `plan.recompute` true / false and a
pinned `parallel.context_parallel` fix them instead (moeflow/parallel/planner.py: `evaluate`).

    python -c "from moeflow.parallel.remedies import remedies"   # library
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from moeflow.model.params import ModelSpec
from moeflow.parallel.memory import FRAGMENTATION, Breakdown, Plan, Workload


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def fixed_part(mem: Breakdown) -> float:
    """Bytes of a breakdown that no activation remedy reduces (all but activations and
    the fragmentation share they carry)."""
    return mem.total - mem.parts["activations"] * (1 + FRAGMENTATION)


def remedies(spec: ModelSpec, p: Plan, work: Workload, auto_cp: bool) -> Iterator[tuple[Plan, Workload]]:
    """(plan, workload) in the order the planner tries them (module docstring); `p` itself first."""
    if work.mode != "lora":
        yield p, work
        return
    choices = [False, True] if work.recompute is None else [work.recompute]
    for rc in choices:
        yield p, replace(work, recompute=rc)
    if auto_cp and p.cp == 1:  # with recompute unless it is pinned off
        for c in divisors(p.dp)[1:]:
            yield replace(p, cp=c), replace(work, recompute=choices[-1])
