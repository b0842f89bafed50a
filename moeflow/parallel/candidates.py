"""A plan checked against the rules, memory and the cost model, and a search's outcome.

    python -c "from moeflow.parallel.candidates import Candidate, PlanResult"   # library
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moeflow.core.hardware import HardwareSpec
from moeflow.model.params import ModelSpec
from moeflow.parallel.memory import Breakdown, Plan, Workload


@dataclass
class Candidate:
    """One (TP, PP, EP, DP, FSDP) point: its memory, its cost, or why it was rejected."""

    plan: Plan
    rejected: str | None = None
    memory: Breakdown | None = None
    cost: dict[str, float] = field(default_factory=dict)
    work: Workload | None = None  # the workload it was evaluated with (recompute chosen)

    @property
    def score(self) -> float:
        return self.cost.get("throughput_tok_s", 0.0)

    def label(self) -> str:
        p = self.plan
        extra = f" CP{p.cp}" if p.cp > 1 else ""
        if self.work is not None and self.work.mode == "lora" and self.work.recompute:
            extra += " +recompute"
        return f"TP{p.tp} PP{p.pp} EP{p.ep} DP{p.dp} FSDP{p.fsdp}{extra}"

    @property
    def breakdown(self) -> Breakdown:
        """`memory` of a candidate that reached the memory check (every feasible one)."""
        if self.memory is None:
            raise ValueError(f"{self.label()} was rejected before its memory was computed")
        return self.memory


@dataclass
class PlanResult:
    """Outcome of a search: the best plan, the next ones, and why others lost."""

    spec: ModelSpec
    hardware: HardwareSpec
    work: Workload
    runtime: str
    candidates: list[Candidate]
    smallest: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.rejected is None),
                      key=lambda c: (-c.score, c.memory.total if c.memory else 0))

    @property
    def best(self) -> Candidate | None:
        return self.feasible[0] if self.feasible else None

    def rejected_summary(self) -> dict[str, int]:
        """Rejection reason -> how many candidates it removed."""
        out: dict[str, int] = {}
        for c in self.candidates:
            if c.rejected:
                key = c.rejected if not c.rejected.startswith("needs ") else "over the device memory budget"
                out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
