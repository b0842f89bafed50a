"""What the planner says: why nothing fits, the weights alone, the notes on a plan, and the
rows of its alternatives table.

    python -c "from moeflow.parallel.messages import infeasible_message"   # library
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from moeflow.core.hardware import HardwareSpec
from moeflow.model.params import ModelSpec, count_params
from moeflow.parallel.candidates import Candidate, PlanResult
from moeflow.parallel.memory import Workload, human, memory_for_plan, precision_label, weight_bytes
from moeflow.parallel.rules import WHY_EXPERT_LORA_EP, target_kinds


def weights_alone(spec: ModelSpec, hw: HardwareSpec, weight_dtype: str = "bf16") -> dict:
    """Total weight bytes and the devices they fill before anything else."""
    counts = count_params(spec)
    nbytes = weight_bytes(counts.by_kind, weight_dtype, spec.precision)
    bf16 = weight_bytes(counts.by_kind, "bf16")
    return {"dtype": precision_label(weight_dtype, spec.precision), "precision": dict(spec.precision),
            "bytes": nbytes, "tb": nbytes / 1e12, "of_bf16": round(nbytes / bf16, 4),
            "devices": math.ceil(nbytes / hw.memory_bytes),
            "device_gb": hw.memory_per_device_gb}


def infeasible_message(result: PlanResult) -> str:
    """One line: why nothing fits and the smallest hardware that would."""
    hw, w = result.hardware, weights_alone(result.spec, result.hardware, result.work.weight_dtype)
    msg = (f"no {result.work.mode} plan fits {hw.describe()}: weights alone are "
           f"{w['bytes'] / 1e9:.1f} GB in {w['dtype']} ({w['devices']} x {hw.memory_per_device_gb:g} GB devices)")
    if result.smallest:
        s = result.smallest
        msg += (f"; the smallest that fits is {s['nodes']} node(s) = {s['devices']} devices of "
                f"{s['hardware']} ({s['plan']})")
    elif result.smallest is None and result.best is None:
        msg += "; no node count up to 4096 fits"
    if result.runtime == "vllm" and hw.cpu_devices and w["devices"] > hw.devices_per_node:
        msg += (f"; on CPU devices a vLLM engine stays on one node (Ray Serve LLM runs vLLM's CPU build with "
                f"its multiprocessing executor): nodes of {w['devices']} or more devices would hold one "
                f"(the hardware spec's devices_per_node, {hw.devices_per_node} here)")
    return msg


def search_notes(spec: ModelSpec, work: Workload, runtime: str) -> list[str]:
    """Notes every search of this workload carries (the runtime's limits it planned around)."""
    notes = []
    if runtime == "transformers" and work.mode == "lora":
        if target_kinds(spec, work) & {"experts", "vision_experts"}:
            notes.append("expert LoRA: EP is 1 or equal to TP — " + WHY_EXPERT_LORA_EP)
    return notes


def activation_notes(spec: ModelSpec, hw: HardwareSpec, best: Candidate, work: Workload) -> list[str]:
    """What the best plan does about its activations, with the numbers that decided it."""
    w, p = best.work or work, best.plan
    if not w.recompute and p.cp == 1:
        return []
    act = best.breakdown.parts["activations"]
    what = " and ".join(x for x in ("recompute per layer" if w.recompute else "",
                                    f"context parallelism CP={p.cp}" if p.cp > 1 else "") if x)
    bare = memory_for_plan(spec, replace(p, cp=1), replace(w, recompute=False), hw.memory_bytes,
                           hw.runtime_overhead_gb * 1e9)
    return [f"seq_len {w.seq_len}: activations {human(bare.parts['activations'])} per device "
            f"without recompute or CP ({human(bare.total)} of {human(bare.budget)} in all); "
            f"the plan trains with {what}: activations {human(act)}, "
            f"{human(best.breakdown.total)} per device"]


def why_pinned_fails(result: PlanResult) -> str:
    """The reason the closest pinned candidate was rejected (memory first, else the rule)."""
    over = [c for c in result.candidates if c.memory is not None]
    if over:
        closest = min(over, key=lambda c: c.breakdown.over_by())
        return f"{closest.label()} {closest.rejected}"
    if result.candidates:
        return result.candidates[0].rejected or "rejected"
    return f"no plan has these degrees on {result.hardware.world_size} devices"


def fmt_fixed(fixed: dict[str, int]) -> str:
    """Pinned degrees as the messages print them: "TP=8 EP=16"."""
    return " ".join(f"{k.upper()}={v}" for k, v in fixed.items())


def candidate_row(c: Candidate) -> dict:
    """One row of the alternatives table: the plan, its memory and its score."""
    row: dict[str, Any] = {"plan": c.label(), **c.plan.as_dict(), "rejected": c.rejected,
                           "recompute": bool(c.work and c.work.mode == "lora" and c.work.recompute)}
    if c.memory:
        row["memory_gb"] = round(c.memory.total / 1e9, 6)
    row.update({k: v for k, v in c.cost.items() if k in ("throughput_tok_s", "step_s", "tpot_s")})
    return row


def alternatives_table(result: PlanResult, limit: int = 20) -> list[dict]:
    """Rows of the best `limit` feasible plans, then the closest infeasible ones."""
    feas = result.feasible[:limit]
    mem_fail = sorted((c for c in result.candidates if c.rejected and c.memory),
                      key=lambda c: c.breakdown.over_by())[:max(0, limit - len(feas))]
    return [candidate_row(c) for c in feas + mem_fail]
