"""The serving search's space: the knobs it tunes, and the candidate settings to try.

Holds the knob names (ENGINE_KNOBS, SERVE_KNOBS, KNOBS), the knobs the local engine
implements (engine_fields), the memory bounds of a setting (Limits, memory_limits: the KV
cache of max_num_seqs sequences at the full context must fit one device beside the weights)
and the candidates spread over the space within them (make_candidates). moeflow.serving.tune
deploys and measures them.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass

from moeflow.core.errors import UserError
from moeflow.model.params import spec_from_path
from moeflow.parallel.memory import Plan, Workload, memory_for_plan

# the knobs searched, under the deploy: section's names (vLLM's for the engine ones)
ENGINE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                "long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills")
SERVE_KNOBS = ("num_replicas", "max_ongoing_requests")
KNOBS = ENGINE_KNOBS + SERVE_KNOBS


def engine_fields() -> set[str]:
    """The knobs the local engine implements (EngineConfig fields)."""

    # lazy: loads torch, which importing this module does not
    from moeflow.serving.engine import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


# ------------------------------------------------------------------ candidates


@dataclass
class Limits:
    """What bounds the search: sequences whose KV cache fits, replicas the devices allow."""

    max_num_seqs: int
    max_replicas: int
    kv_bytes_per_seq: float = 0.0  # at the full context
    free_bytes: float = 0.0  # per device, after weights, activations and runtime overhead
    why: str = ""


def memory_limits(model_dir: str, hw, plan: dict, context: int, weight_dtype: str,
                  kv_dtype: str) -> Limits:
    """KV bytes per token x context x sequences must fit next to the weights on one device.

    Args:
        hw: HardwareSpec; plan: the plan stage's serving sub-plan (tensor/pipeline/expert degrees).
        context: tokens per sequence (max_model_len).
    """

    spec = spec_from_path(model_dir)
    p = Plan(tp=int(plan.get("tensor_parallel") or 1), pp=int(plan.get("pipeline_parallel") or 1),
             ep=int(plan.get("expert_parallel") or 1))

    def total(batch: int) -> float:
        work = Workload(mode="inference", batch=batch, context=context, prefill_chunk=context,
                        weight_dtype=weight_dtype, kv_dtype=kv_dtype)
        return memory_for_plan(spec, p, work, hw.memory_bytes, hw.runtime_overhead_gb * 1e9).total

    one, two = total(1), total(2)
    per_seq = max(two - one, 1.0)  # KV (and its activations) of one more sequence
    free = hw.memory_bytes - (one - per_seq)
    seqs = int(free // per_seq)
    if seqs < 1:
        raise UserError(f"serving: not even one sequence of {context} tokens fits a "
                        f"{hw.memory_per_device_gb:g} GB device next to the weights ({hw.name})")
    replicas = max(1, hw.world_size // (p.tp * p.pp))
    why = (f"KV {per_seq / 1e6:.2f} MB per {context}-token sequence, {free / 1e9:.2f} GB free per "
           f"device -> at most {seqs} sequences; {hw.world_size} devices / (TP {p.tp} x PP {p.pp}) "
           f"-> at most {replicas} replicas")
    return Limits(seqs, replicas, per_seq, free, why)


def _valid(c: dict, limits: Limits) -> bool:
    if c["max_num_seqs"] > limits.max_num_seqs or c["num_replicas"] > limits.max_replicas:
        return False
    # a replica admitting fewer requests than its engine batches can never fill the batch
    if c["max_ongoing_requests"] < c["max_num_seqs"]:
        return False
    thr = c.get("long_prefill_token_threshold")
    if thr is not None and thr > c["max_num_batched_tokens"]:
        return False
    if c.get("max_num_partial_prefills") and c["max_long_partial_prefills"] > c["max_num_partial_prefills"]:
        return False  # vLLM's constraint
    return True


def make_candidates(space: dict[str, list], default: dict, limits: Limits, n: int,
                    seed: int = 0) -> list[dict]:
    """Default first, then up to `n - 1` valid settings spread over the space.

    Picks greedily the setting farthest (most knobs different) from those picked, so
    a few candidates still cover every value of every knob.
    """
    keys = [k for k in KNOBS if k in space or k in default]
    axes = [list(space.get(k) or [default.get(k)]) for k in keys]
    combos = itertools.product(*axes)
    pool = [dict(zip(keys, values)) for values in itertools.islice(combos, 20000)]
    pool = [c for c in pool if _valid(c, limits) and c != {k: default.get(k) for k in keys}]
    rng = random.Random(seed)
    rng.shuffle(pool)
    picked: list[dict] = [dict(default)]
    while pool and len(picked) < n:
        def distance(c):
            return min(sum(c[k] != p.get(k) for k in keys) for p in picked)
        best = max(pool, key=distance)
        pool.remove(best)
        picked.append(dict(default, **best))
    return picked
