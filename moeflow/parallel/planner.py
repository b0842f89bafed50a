"""Parallel-strategy search: TP x PP x EP x DP (+ FSDP) for a model on a hardware spec.

Every candidate with world size = the hardware's device count is checked
against structural rules (moeflow/parallel/rules.py: divisibility, TP inside the
high-bandwidth domain, the runtime's known limits), then against device memory
(`moeflow.parallel.memory`), and the feasible ones are ranked by the cost model
(moeflow/parallel/cost.py, shared with the dry run). The plan record (`plan.json`,
moeflow/parallel/translate.py) is what finetune and deploy apply.

Activation remedies (lora): a plan whose activations do not fit is evaluated
again with per-layer recompute (one more forward), then with recompute and
context parallelism CP = 2, 4, ... (CP divides DP, the heads per TP rank and the
sequence), and keeps the first that fits; `plan.recompute` true / false and a
pinned `parallel.context_parallel` fix them instead. The notes say which.

    python -c "from moeflow.parallel.planner import *"   # `moeflow plan --help` is the CLI
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

from moeflow.core.errors import UserError
from moeflow.core.hardware import HardwareSpec
from moeflow.model.params import ModelSpec, count_params
from moeflow.parallel.candidates import Candidate, PlanResult
from moeflow.parallel.cost import MFU, inference_cost, lora_cost, lora_params_on_rank
from moeflow.parallel.memory import Plan, Workload, human, memory_for_plan
from moeflow.parallel.messages import (
    activation_notes,
    alternatives_table,
    fmt_fixed,
    infeasible_message,
    search_notes,
    weights_alone,
    why_pinned_fails,
)
from moeflow.parallel.remedies import divisors, fixed_part, remedies
from moeflow.parallel.rules import RUNTIMES, structural_reason
from moeflow.parallel.translate import (
    DEGREE_KEYS,
    distributed_config,
    expected_rank_bytes,
    long_key,
    plan_from_record,
    plan_record,
)

# the planner's public names, wherever they are defined (callers import them from here)
__all__ = ["Candidate", "PlanResult", "MFU", "RUNTIMES", "DEGREE_KEYS", "enumerate_plans", "evaluate",
           "search", "smallest_hardware", "plan_with_degrees", "nearest_plan", "weights_alone",
           "infeasible_message", "alternatives_table", "why_pinned_fails", "distributed_config",
           "plan_record", "plan_from_record", "expected_rank_bytes", "structural_reason"]

MAX_PP = 64



def enumerate_plans(spec: ModelSpec, hw: HardwareSpec, work: Workload,
                    fixed: dict[str, int] | None = None) -> list[Plan]:
    """All degree combinations with TP x PP x DP = world (EP, FSDP subdividing), honouring `fixed`."""
    fixed = fixed or {}
    world = hw.world_size
    out = []
    for tp in divisors(world):
        for pp in (d for d in divisors(world // tp) if d <= MAX_PP):
            dp = world // (tp * pp)
            for ep in (e for e in divisors(spec.num_experts) if e <= tp * dp):
                for fsdp in (divisors(dp) if work.mode == "lora" else [1]):
                    p = Plan(tp=tp, pp=pp, ep=ep, dp=dp, fsdp=fsdp, cp=fixed.get("cp", 1))
                    if all(getattr(p, k) == v for k, v in fixed.items()):
                        out.append(p)
    return out


# ------------------------------------------------------------ search


def evaluate(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload,
             runtime: str = "transformers", counts=None, auto_cp: bool = False) -> Candidate:
    """Check one plan: structure, memory, then cost. A LoRA plan whose activations do
    not fit is tried with the remedies in order (module docstring): recompute when
    `work.recompute` is None, then CP = 2, 4, ... when `auto_cp`; the first that
    fits is returned, else the plan as given (its memory says by how much it fails)."""
    why = structural_reason(spec, hw, p, work, runtime)
    if why:
        return Candidate(p, rejected=why, work=work)
    counts = counts or count_params(spec)
    first = None
    for q, w in remedies(spec, p, work, auto_cp):
        if q is not p and structural_reason(spec, hw, q, w, runtime):
            continue
        cand = _evaluate_one(spec, hw, q, w, counts)
        first = first or cand
        if cand.rejected is None:
            return cand
        if cand.memory is not None and fixed_part(cand.memory) > cand.memory.budget:
            break  # over budget before any activation: recompute and CP cannot help
    assert first is not None  # remedies yields `p` itself first
    return first


def _evaluate_one(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload, counts) -> Candidate:
    mem = memory_for_plan(spec, p, work, hw.memory_bytes, hw.runtime_overhead_gb * 1e9)
    cand = Candidate(p, memory=mem, work=work)
    if not mem.fits:
        worst = max(mem.parts, key=lambda k: mem.parts[k])
        cand.rejected = (f"needs {human(mem.total)} per device, over the {human(mem.budget)} "
                         f"device memory budget by {human(mem.over_by())} "
                         f"(largest part: {worst} {human(mem.parts[worst])})")
        return cand
    if work.mode == "lora":
        cand.cost = lora_cost(spec, hw, p, work, counts, lora_params_on_rank(spec, p, work), mem)
    else:
        cand.cost = inference_cost(spec, hw, p, work, counts, mem)
    return cand


def search(spec: ModelSpec, hw: HardwareSpec, work: Workload, runtime: str = "transformers",
           fixed: dict[str, int] | None = None, find_smallest: bool = True) -> PlanResult:
    """Enumerate, check and rank every plan for `hw`.

    Args:
        spec: model; hw: hardware (its node count sets the world size); work: workload.
        runtime: "transformers" applies the measured transformers/PEFT limits;
            "generic" assumes a runtime without them (Megatron, vLLM).
        fixed: degrees pinned by the user ({"tp": 8, ...}); the rest are searched.
        find_smallest: when nothing fits, search the smallest node count that would.
    Returns:
        PlanResult (best, alternatives, rejection reasons, smallest hardware).
    """
    if runtime not in RUNTIMES:
        raise UserError(f"plan.runtime must be one of {', '.join(RUNTIMES)} (got {runtime!r})")
    counts = count_params(spec)
    auto_cp = "cp" not in (fixed or {})
    cands = [evaluate(spec, hw, p, work, runtime, counts, auto_cp)
             for p in enumerate_plans(spec, hw, work, fixed)]
    result = PlanResult(spec, hw, work, runtime, cands, notes=search_notes(spec, work, runtime))
    best = result.best
    if best and runtime == "transformers" and work.mode == "inference" and best.plan.tp > 1:
        result.notes.append("TP>1: serve merged adapters — unmerged PEFT LoRA on transformers "
                            "tensor parallel fails (docs/facts.md)")
    if best and work.mode == "lora":
        result.notes += activation_notes(spec, hw, best, work)
    if result.best is None and find_smallest:
        result.smallest = smallest_hardware(spec, hw, work, runtime, fixed)
        if work.weight_dtype in ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
            low = Workload(**{**work.__dict__, "weight_dtype": "fp8"})
            alt = search(spec, hw, low, runtime, fixed, find_smallest=False).best
            if alt:  # low precision is the other way out; say so
                result.notes.append(f"with fp8 weights it fits this hardware as {alt.label()} "
                                    f"({human(alt.breakdown.total)} per device)")
    return result


def smallest_hardware(spec: ModelSpec, hw: HardwareSpec, work: Workload, runtime: str,
                      fixed: dict[str, int] | None = None, max_nodes: int = 4096) -> dict | None:
    """Fewest nodes of `hw`'s kind on which some plan fits (doubling, then bisection)."""
    def best_at(n: int) -> Candidate | None:
        res = search(spec, hw.with_nodes(n), work, runtime, fixed, find_smallest=False)
        return res.best

    lo, hi = hw.nodes, hw.nodes * 2
    while hi <= max_nodes and best_at(hi) is None:
        lo, hi = hi, hi * 2
    if hi > max_nodes:
        return None
    while hi - lo > 1:  # invariant: lo fails, hi fits
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if best_at(mid) else (mid, hi)
    c = best_at(hi)
    return {"nodes": hi, "devices": hi * hw.devices_per_node, "hardware": hw.name,
            "plan": c.label() if c else None}


# ------------------------------------------------------------ explicit degrees, records


def plan_with_degrees(spec: ModelSpec, hw: HardwareSpec, work: Workload, degrees: dict[str, Any],
                      runtime: str = "transformers", policy: str = "strict") -> PlanResult:
    """Search with the user's explicit degrees pinned ("auto" or None: searched).

    Args:
        policy: "strict": pinned degrees that cannot run raise; "nearest": they are
            replaced by the nearest plan that runs (`nearest_plan`), the reason recorded.
    Raises:
        UserError: (strict) the pinned degrees cannot run here — names the broken rule,
            or the memory budget and by how much the closest such plan exceeds it.
    """
    fixed = {DEGREE_KEYS[k]: int(v) for k, v in degrees.items()
             if k in DEGREE_KEYS and v not in (None, "auto")}
    result = search(spec, hw, work, runtime, fixed=fixed, find_smallest=not fixed)
    if not fixed or result.best is not None:
        if fixed:
            result.notes.append("explicit degrees " + fmt_fixed(fixed) + " checked against the plan")
        return result
    if policy == "nearest":
        return nearest_plan(spec, hw, work, fixed, runtime, why_pinned_fails(result))
    where = f"parallel {fmt_fixed(fixed)} on {hw.describe()}"
    if not result.candidates:
        raise UserError(f"{where}: no plan has these degrees (TP x PP x DP must equal "
                        f"{hw.world_size} devices, EP must divide {spec.num_experts} experts)")
    over = [c for c in result.candidates if c.memory is not None]
    if not over:
        raise UserError(f"{where}: {result.candidates[0].rejected}")
    closest = min(over, key=lambda c: c.breakdown.over_by())
    raise UserError(f"{where} is infeasible: {closest.label()} {closest.rejected}")


def nearest_plan(spec: ModelSpec, hw: HardwareSpec, work: Workload, fixed: dict[str, int],
                 runtime: str, why: str, min_seq: int = 1024) -> PlanResult:
    """The runnable plan nearest to pinned degrees that cannot run.

    Keeps as many pins as possible (fewest released first, then the best score);
    when no degrees fit the workload at all, halves a LoRA `seq_len` until one does.
    The notes say what was replaced and why.

    Raises:
        UserError: nothing runs even with every pin released and the shortest sequence.
    """

    keys, res = list(fixed), None
    for n_free in range(1, len(keys) + 1):
        best: tuple[tuple[str, ...], PlanResult, Candidate] | None = None
        for free in combinations(keys, n_free):
            kept = {k: v for k, v in fixed.items() if k not in free}
            res = search(spec, hw, work, runtime, fixed=kept, find_smallest=False)
            if res.best and (best is None or res.best.score > best[2].score):
                best = (free, res, res.best)
        if best:
            free, res, chosen = best
            got = ", ".join(f"{k.upper()}={v}->{getattr(chosen.plan, k)}" for k, v in fixed.items()
                            if k in free)
            res.notes.append(f"pinned {fmt_fixed(fixed)} cannot run ({why}); nearest runnable "
                             f"plan replaces {got}")
            return res
    if work.mode == "lora" and work.seq_len // 2 >= min_seq:
        shorter = Workload(**{**work.__dict__, "seq_len": work.seq_len // 2})
        unpinned = why_pinned_fails(res) if res else why  # with every pin released
        res = plan_with_degrees(spec, hw, shorter, {long_key(k): v for k, v in fixed.items()},
                                runtime, policy="nearest")
        res.notes.insert(0, f"seq_len {work.seq_len} fits no plan on {hw.name} (closest: {unpinned}); "
                            f"planned at seq_len {res.work.seq_len}: finetune trains at it")
        return res
    raise UserError(f"parallel {fmt_fixed(fixed)} on {hw.describe()}: nothing runs near it ({why})")


