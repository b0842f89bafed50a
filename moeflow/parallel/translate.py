"""A plan in the runtimes' terms: transformers' `DistributedConfig`, the `plan.json` record
finetune and deploy apply, and the bytes each rank must hold after loading by it.

    python -c "from moeflow.parallel.translate import distributed_config"   # library
"""

from __future__ import annotations

from typing import Any

from moeflow.core.errors import UserError
from moeflow.model.params import count_params, model_spec, spec_from_path
from moeflow.parallel.candidates import PlanResult
from moeflow.parallel.memory import Plan, planned_rank_bytes
from moeflow.parallel.messages import candidate_row, infeasible_message, weights_alone

DEGREE_KEYS = {"tensor_parallel": "tp", "pipeline_parallel": "pp", "expert_parallel": "ep",
               "data_parallel": "dp", "fsdp": "fsdp", "context_parallel": "cp"}


def long_key(short: str) -> str:
    """The config key of a degree ("tp" -> "tensor_parallel")."""
    return next(k for k, v in DEGREE_KEYS.items() if v == short)


def distributed_config(p: Plan, mode: str) -> dict[str, Any] | None:
    """kwargs of transformers' `DistributedConfig` for this plan (None: plain replicas).

    Plain data parallelism (no TP/EP/FSDP/PP) needs no DistributedConfig: the
    runtime replicates the model (Ray Train DDP, or Serve replicas).
    """
    if p.tp == p.pp == p.ep == p.fsdp == 1:
        return None
    cfg: dict[str, Any] = {"tp_size": p.tp, "pp_size": p.pp, "ep_size": p.ep}
    if mode == "lora" and p.fsdp > 1:
        cfg.update(fsdp_size=p.fsdp, dp_replicate_size=p.dp // p.fsdp)
    return cfg


def plan_record(result: PlanResult, model_path: str | None = None, top: int = 5) -> dict:
    """The JSON plan (`plan.json`): degrees, memory, cost, alternatives, rejections.

    Raises:
        UserError: nothing fits; the message names the smallest hardware that would.
    """
    best, hw = result.best, result.hardware
    if best is None:
        raise UserError(infeasible_message(result))
    work = best.work or result.work
    counts = count_params(result.spec)
    p = best.plan
    impl = "fsdp2" if p.fsdp > 1 and p.fsdp == p.dp else "hsdp" if p.fsdp > 1 else "ddp"
    return {
        "num_workers": p.world, **p.as_dict(), "mode": work.mode, "runtime": result.runtime,
        "data_parallel_impl": impl if p.dp > 1 else "none",
        "distributed_config": distributed_config(p, work.mode),
        "hardware": {"name": hw.name, "nodes": hw.nodes, "devices_per_node": hw.devices_per_node,
                     "memory_per_device_gb": hw.memory_per_device_gb, "source": hw.source},
        "model": {"path": model_path, "family": result.spec.family, **counts.as_dict(),
                  "weights": weights_alone(result.spec, hw, work.weight_dtype)},
        "workload": {k: (list(v) if isinstance(v, tuple) else v) for k, v in work.__dict__.items()},
        "recompute": bool(work.recompute) if work.mode == "lora" else False,
        "memory": best.breakdown.as_dict(), "cost": best.cost,
        "alternatives": [candidate_row(c) for c in result.feasible[1:top + 1]],
        "rejected": result.rejected_summary(),
        "notes": result.notes,
    }


def plan_from_record(plan: dict) -> Plan:
    """Plan degrees from a plan record / plan.json dict."""
    try:  # records written before context parallelism have no CP degree: 1
        return Plan(**{short: int(plan[long] if long != "context_parallel"
                                  else plan.get(long) or 1) for long, short in DEGREE_KEYS.items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"plan record lacks a valid degree: {exc}") from None


def expected_rank_bytes(plan: dict, model_config: str | dict, rank: int,
                        dtype: str = "bfloat16") -> int:
    """Bytes of base parameters rank `rank` must hold after loading by a plan record.

    Args:
        plan: the `plan` record (or plan.json) with the degree keys.
        model_config: config.json path / checkpoint dir, or the parsed dict.
        rank: global rank (TP innermost: rank = tp + TP * (dp + DP * pp)).
        dtype: the dtype the model is loaded in.
    """

    spec = model_spec(model_config) if isinstance(model_config, dict) else spec_from_path(model_config)
    return planned_rank_bytes(spec, plan_from_record(plan), rank, dtype)
