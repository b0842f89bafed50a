"""Parallel-strategy search: TP x PP x EP x DP (+ FSDP) for a model on a hardware spec.

Every candidate with world size = the hardware's device count is checked
against structural rules (divisibility, TP inside the high-bandwidth domain,
the runtime's known limits), then against device memory (`moeflow.memory`),
and the feasible ones are ranked by the cost model below. The plan record
(`plan.json`) is what finetune and deploy apply.

Cost model (all constants named below; a ranking aid, not a promise):
  lora, per optimizer step with m = grad_accum micro-batches of T = micro_batch x seq_len
  tokens per DP rank:
    t_mb    = T * F * k / (TP * PP * peak * MFU)               compute of one micro-batch on one stage
              F = 2 * active non-embedding params + causal attention 2 * seq * heads * head_dim * layers
              k = 2 (forward + input-gradient backward; the base is frozen) + 1 with recompute
            + TP: 2 all-reduces per layer and pass, 2 (TP-1)/TP * T * H * 2 B over the TP link
            + EP: dispatch + combine per MoE layer and pass, T * top_k * H * 2 B * (EP-1)/EP
              over the link the EP group spans
            + FSDP: all-gather of the stage's sharded weights per pass, (FSDP-1)/FSDP of them
            + PP: activations T * H * 2 B to the next stage
            + CP: 4 all-to-alls per layer and pass (q, k, v, attention output) of the
              rank's T / CP tokens, (CP-1)/CP of them crossing; compute and the TP / EP
              terms then count T / CP tokens per rank
    step    = (m + PP - 1) * t_mb                              (1F1B: the bubble is PP - 1 micro-batches)
            + DP all-reduce of the LoRA gradients only, 2 (DP-1)/DP * 4 B * LoRA params
    score   = tokens per second = DP / CP * m * T / step
  inference, one decode step of `batch` sequences per DP replica:
    t_stage = max(bytes read / HBM bandwidth, 2 * active * batch / (TP * PP) / (peak * MFU))
              bytes read = dense weights + the experts the batch touches
              (1 - (1 - k/E)^tokens of the EP group) + the KV cache
            + TP / EP / PP collectives per layer as above, each with a fixed latency ALPHA
    TPOT    = PP * t_stage (a token crosses every stage; decode micro-batching is not modelled)
    score   = tokens per second = DP * batch / TPOT
Every collective pays ALPHA_INTRA inside a node or ALPHA_INTER across nodes.

Activation remedies (lora): a plan whose activations do not fit is evaluated
again with per-layer recompute (one more forward), then with recompute and
context parallelism CP = 2, 4, ... (CP divides DP, the heads per TP rank and the
sequence), and keeps the first that fits; `plan.recompute` true / false and a
pinned `parallel.context_parallel` fix them instead. The notes say which.

    python -c "from moeflow.planner import *"   # `moeflow plan --help` is the CLI
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any

from moeflow.errors import UserError
from moeflow.hardware import HardwareSpec
from moeflow.memory import (
    FRAGMENTATION,
    Breakdown,
    Plan,
    Workload,
    dtype_bytes,
    human,
    lora_numel,
    lora_targets,
    memory_for_plan,
    planned_rank_bytes,
    precision_label,
    stage_layers,
    weight_bytes,
)
from moeflow.params import ModelSpec, count_params, model_spec, spec_from_path

MFU = 0.4  # fraction of peak FLOP/s a tuned MoE kernel stack sustains
ALPHA_INTRA = 5e-6  # seconds of latency per collective inside a node
ALPHA_INTER = 15e-6  # ... across nodes
MAX_PP = 64
RUNTIMES = ("transformers", "generic", "vllm")

# measured limits of the transformers + PEFT runtime (docs/facts.md)
WHY_EXPERT_LORA_EP = ("PEFT expert LoRA does not combine with transformers expert parallelism "
                      "(DTensor mixing); moeflow's split expert LoRA runs on EP-sharded experts "
                      "when EP equals TP (the EP group is the TP group) without FSDP; plan "
                      "EP equal to TP, or EP 1")
WHY_CP_LINEAR = ("context parallelism splits softmax attention only; the linear-attention "
                 "layers' recurrence is not split")


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _targets_kinds(spec: ModelSpec, work: Workload) -> set[str]:
    return {t.kind for t in lora_targets(spec, work.lora_targets)}


def structural_reason(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload,
                      runtime: str = "transformers") -> str | None:
    """Why `p` cannot run at all (None: it can, memory permitting)."""
    if p.world != hw.world_size:
        return f"uses {p.world} devices, the hardware has {hw.world_size}"
    if p.tp > (hw.hbd_size or hw.devices_per_node):
        return f"TP={p.tp} exceeds the high-bandwidth domain ({hw.hbd_size} devices)"
    if spec.heads % p.tp:
        return f"TP={p.tp} does not divide {spec.heads} attention heads"
    if spec.attention != "mla" and spec.kv_heads % p.tp and p.tp % spec.kv_heads:
        return f"TP={p.tp} neither divides nor is a multiple of {spec.kv_heads} KV heads"
    if p.pp > spec.layers:
        return f"PP={p.pp} exceeds {spec.layers} layers"
    if p.ep > 1 and spec.num_experts % p.ep:
        return f"EP={p.ep} does not divide {spec.num_experts} experts"
    if p.ep > 1 and (p.ep % p.tp or (p.tp * p.dp) % p.ep):
        return f"EP={p.ep} must be a multiple of TP={p.tp} and divide TP x DP={p.tp * p.dp}"
    if p.dp % p.fsdp:
        return f"FSDP={p.fsdp} does not divide DP={p.dp}"
    if work.mode == "inference" and p.fsdp > 1:
        return "FSDP is for training"
    if p.cp > 1:
        why = _cp_reason(spec, p, work)
        if why:
            return why
    if runtime == "transformers":
        return _transformers_reason(spec, p, work)
    if runtime == "vllm":
        return _vllm_reason(p, work)
    return None


def _cp_reason(spec: ModelSpec, p: Plan, work: Workload) -> str | None:
    """Why context parallelism of degree p.cp cannot run (None: it can)."""
    if work.mode != "lora":
        return "context parallelism is for training"
    if p.dp % p.cp:
        return f"CP={p.cp} does not divide DP={p.dp}"
    local = spec.heads // p.tp if spec.attention != "mla" else spec.heads
    if local % p.cp:
        return f"CP={p.cp} does not divide the {local} attention heads per TP rank"
    if work.seq_len % p.cp:
        return f"CP={p.cp} does not divide seq_len {work.seq_len}"
    if spec.linear_attention_layers:
        return WHY_CP_LINEAR
    return None


def _vllm_reason(p: Plan, work: Workload) -> str | None:
    """What vLLM (behind Ray Serve LLM) cannot run: it serves; its EP group is TP x engine DP."""
    if work.mode != "inference":
        return "the vllm runtime serves (plan.mode inference); LoRA training runs on transformers"
    return None  # expert LoRA under EP: deploy serves such adapters merged (vllm_backend)


def _transformers_reason(spec: ModelSpec, p: Plan, work: Workload) -> str | None:
    """Limits of transformers' DistributedConfig and PEFT (measured, docs/facts.md)."""
    if work.mode == "lora":
        kinds = _targets_kinds(spec, work)
        if p.ep > 1 and (p.ep != p.tp or p.fsdp > 1) and kinds & {"experts", "vision_experts"}:
            return WHY_EXPERT_LORA_EP
        if p.ep > 1 and (p.fsdp * p.tp) % p.ep:
            return f"transformers places EP groups inside FSDP x TP: EP={p.ep} needs FSDP x TP divisible by it"
        if p.fsdp not in (1, p.dp):  # what moeflow.training.driver.check_plan accepts
            return f"the finetune stage shards over all data ranks (no HSDP replicas): FSDP must be 1 or DP={p.dp}"
    elif p.ep > 1 and p.ep != p.tp:
        return "transformers serves EP inside one replica: EP must equal TP"
    if p.pp > 1 and p.dp > 1:
        return "transformers does not combine pipeline parallelism with data parallelism / FSDP"
    if p.pp > 1 and p.ep > p.tp:
        return "transformers does not combine EP token dispatch with pipeline parallelism"
    return None


def enumerate_plans(spec: ModelSpec, hw: HardwareSpec, work: Workload,
                    fixed: dict[str, int] | None = None) -> list[Plan]:
    """All degree combinations with TP x PP x DP = world (EP, FSDP subdividing), honouring `fixed`."""
    fixed = fixed or {}
    world = hw.world_size
    out = []
    for tp in _divisors(world):
        for pp in (d for d in _divisors(world // tp) if d <= MAX_PP):
            dp = world // (tp * pp)
            for ep in (e for e in _divisors(spec.num_experts) if e <= tp * dp):
                for fsdp in (_divisors(dp) if work.mode == "lora" else [1]):
                    p = Plan(tp=tp, pp=pp, ep=ep, dp=dp, fsdp=fsdp, cp=fixed.get("cp", 1))
                    if all(getattr(p, k) == v for k, v in fixed.items()):
                        out.append(p)
    return out


# ------------------------------------------------------------ cost model


def _alpha(hw: HardwareSpec, span: int) -> float:
    return ALPHA_INTRA if span <= hw.devices_per_node else ALPHA_INTER


def _allreduce(hw: HardwareSpec, n: int, nbytes: float, span: int) -> float:
    """Ring all-reduce time of `nbytes` over `n` ranks spanning `span` devices."""
    if n <= 1:
        return 0.0
    return _alpha(hw, span) + 2 * (n - 1) / n * nbytes / hw.link_bandwidth(span)


def _alltoall(hw: HardwareSpec, n: int, nbytes: float, span: int) -> float:
    """All-to-all time when each rank holds `nbytes` and keeps 1/n of them."""
    if n <= 1:
        return 0.0
    return _alpha(hw, span) + (n - 1) / n * nbytes / hw.link_bandwidth(span)


def _flops_per_token(spec: ModelSpec, counts, seq: int) -> float:
    """Forward FLOPs of one token: 2 per active matmul parameter + causal attention."""
    matmul = counts.active - counts.active_by_kind.get("embed", 0)
    if spec.tie_embeddings:  # the tied embedding is also the head matmul
        matmul += counts.active_by_kind.get("embed", 0)
    return 2 * matmul + 2 * seq * spec.heads * spec.head_dim * spec.layers


def lora_cost(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload, counts,
              lora_rank_params: float, mem: Breakdown) -> dict[str, float]:
    """Seconds per optimizer step and tokens/s of a LoRA plan (module docstring)."""
    H, m = spec.hidden, max(1, work.grad_accum)
    T = work.micro_batch * work.seq_len / p.cp  # tokens per rank: CP splits each sequence
    passes = 3 if work.recompute is not False else 2
    first = stage_layers(spec.layers, p.pp, 0)  # the largest stage sets the pace
    L, moe_l = len(first), len(set(first) & set(spec.moe_layers))
    compute = T * _flops_per_token(spec, counts, work.seq_len) * passes / (
        p.tp * p.pp * hw.peak_flops("bf16") * MFU)
    act = T * H * dtype_bytes(work.act_dtype)
    tp = L * 2 * passes * _allreduce(hw, p.tp, act, p.tp)
    ep = moe_l * 2 * passes * _alltoall(hw, p.ep, act * spec.experts_per_tok, p.ep)
    # a rank holding 1/f of a tensor receives the other (f - 1)/f of it per gather
    gathered = (mem.parts["weights_dense"] * (p.fsdp - 1)
                + mem.parts["weights_experts"] * (p.efsdp - 1))
    fsdp = 0.0 if p.fsdp <= 1 else passes * (
        _alpha(hw, p.tp * p.fsdp) * L + gathered / hw.link_bandwidth(p.tp * p.fsdp))
    p2p = 0.0 if p.pp <= 1 else 2 * (_alpha(hw, p.world) + act / hw.link_bandwidth(p.tp * p.dp * 2))
    qkvo = T * (2 * spec.heads + 2 * spec.kv_heads) * spec.head_dim / p.tp * dtype_bytes(work.act_dtype)
    cp = 0.0 if p.cp <= 1 else L * passes * 4 * _alltoall(hw, p.cp, qkvo / 4, p.tp * p.cp)
    t_mb = compute + tp + ep + fsdp + p2p + cp
    dp = _allreduce(hw, p.dp, 4 * lora_rank_params, p.tp * p.dp)
    step = (m + p.pp - 1) * t_mb + dp
    return {"step_s": step, "compute_s": m * compute, "tp_comm_s": m * tp, "ep_comm_s": m * ep,
            "fsdp_comm_s": m * fsdp, "pp_bubble_s": (p.pp - 1) * t_mb, "pp_p2p_s": m * p2p,
            "cp_comm_s": m * cp, "dp_comm_s": dp, "throughput_tok_s": p.dp * m * T / step}


def inference_cost(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload, counts,
                   mem: Breakdown) -> dict[str, float]:
    """Seconds per decode step (TPOT), prefill time and tokens/s of a serving plan."""
    H, B, k, E = spec.hidden, work.batch, spec.experts_per_tok, max(1, spec.num_experts)
    group_tokens = B * max(1, p.ep // p.tp)
    touched = 1 - (1 - k / E) ** group_tokens if spec.num_experts else 1.0
    read = (mem.parts["weights_dense"] + mem.parts["weights_experts"] * touched
            + mem.parts["kv_cache"])
    dtype = "fp8" if work.weight_dtype == "fp8" else "bf16"
    flops = 2 * counts.active * B / (p.tp * p.pp)
    t_stage = max(read / (hw.hbm_bandwidth_gbs * 1e9), flops / (hw.peak_flops(dtype) * MFU))
    L = math.ceil(spec.layers / p.pp)
    moe_l = math.ceil(len(spec.moe_layers) / p.pp)
    act = B * H * dtype_bytes(work.act_dtype)
    comm = (L * 2 * _allreduce(hw, p.tp, act, p.tp)
            + moe_l * 2 * _alltoall(hw, p.ep, act * k, p.ep)
            + (0.0 if p.pp <= 1 else _alpha(hw, p.world) + act / hw.link_bandwidth(p.world)))
    tpot = p.pp * (t_stage + comm)
    prompt = work.context * _flops_per_token(spec, counts, work.context) / (
        p.tp * p.pp * hw.peak_flops(dtype) * MFU)
    return {"tpot_s": tpot, "decode_read_bytes": read, "experts_touched": touched,
            "comm_s": p.pp * comm, "ttft_s": prompt + p.pp * comm,
            "throughput_tok_s": p.dp * B / tpot}


def _lora_params_on_rank(spec: ModelSpec, p: Plan, work: Workload) -> float:
    total = sum(lora_numel(t, work.lora_rank) for t in lora_targets(spec, work.lora_targets))
    return total / (p.pp * max(1, p.tp) * (p.fsdp if p.fsdp > 1 else 1))


# ------------------------------------------------------------ search


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
    for q, w in _remedies(spec, p, work, auto_cp):
        if q is not p and structural_reason(spec, hw, q, w, runtime):
            continue
        cand = _evaluate_one(spec, hw, q, w, counts)
        first = first or cand
        if cand.rejected is None:
            return cand
        if cand.memory is not None and _fixed_part(cand.memory) > cand.memory.budget:
            break  # over budget before any activation: recompute and CP cannot help
    assert first is not None  # _remedies yields `p` itself first
    return first


def _fixed_part(mem: Breakdown) -> float:
    """Bytes of a breakdown that no activation remedy reduces (all but activations and
    the fragmentation share they carry)."""

    return mem.total - mem.parts["activations"] * (1 + FRAGMENTATION)


def _remedies(spec: ModelSpec, p: Plan, work: Workload, auto_cp: bool):
    """(plan, workload) in the order the planner tries them (module docstring)."""
    if work.mode != "lora":
        yield p, work
        return
    choices = [False, True] if work.recompute is None else [work.recompute]
    for rc in choices:
        yield p, replace(work, recompute=rc)
    if auto_cp and p.cp == 1:  # with recompute unless it is pinned off
        for c in _divisors(p.dp)[1:]:
            yield replace(p, cp=c), replace(work, recompute=choices[-1])


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
        cand.cost = lora_cost(spec, hw, p, work, counts, _lora_params_on_rank(spec, p, work), mem)
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
    result = PlanResult(spec, hw, work, runtime, cands, notes=_notes(spec, work, runtime))
    best = result.best
    if best and runtime == "transformers" and work.mode == "inference" and best.plan.tp > 1:
        result.notes.append("TP>1: serve merged adapters — unmerged PEFT LoRA on transformers "
                            "tensor parallel fails (docs/facts.md)")
    if best and work.mode == "lora":
        result.notes += _activation_notes(spec, hw, best, work)
    if result.best is None and find_smallest:
        result.smallest = smallest_hardware(spec, hw, work, runtime, fixed)
        if work.weight_dtype in ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
            low = Workload(**{**work.__dict__, "weight_dtype": "fp8"})
            alt = search(spec, hw, low, runtime, fixed, find_smallest=False).best
            if alt:  # low precision is the other way out; say so
                result.notes.append(f"with fp8 weights it fits this hardware as {alt.label()} "
                                    f"({human(alt.breakdown.total)} per device)")
    return result


def _notes(spec: ModelSpec, work: Workload, runtime: str) -> list[str]:
    notes = []
    if runtime == "transformers" and work.mode == "lora":
        kinds = _targets_kinds(spec, work)
        if kinds & {"experts", "vision_experts"}:
            notes.append("expert LoRA: EP is 1 or equal to TP — " + WHY_EXPERT_LORA_EP)
    return notes


def _activation_notes(spec: ModelSpec, hw: HardwareSpec, best: Candidate,
                      work: Workload) -> list[str]:
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


def weights_alone(spec: ModelSpec, hw: HardwareSpec, weight_dtype: str = "bf16") -> dict:
    """Total weight bytes and the devices they fill before anything else."""
    counts = count_params(spec)
    nbytes = weight_bytes(counts.by_kind, weight_dtype, spec.precision)
    bf16 = weight_bytes(counts.by_kind, "bf16")
    return {"dtype": precision_label(weight_dtype, spec.precision), "precision": dict(spec.precision),
            "bytes": nbytes, "tb": nbytes / 1e12, "of_bf16": round(nbytes / bf16, 4),
            "devices": math.ceil(nbytes / hw.memory_bytes),
            "device_gb": hw.memory_per_device_gb}


# ------------------------------------------------------------ explicit degrees, records

DEGREE_KEYS = {"tensor_parallel": "tp", "pipeline_parallel": "pp", "expert_parallel": "ep",
               "data_parallel": "dp", "fsdp": "fsdp", "context_parallel": "cp"}


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
            result.notes.append("explicit degrees " + _fmt_fixed(fixed) + " checked against the plan")
        return result
    if policy == "nearest":
        return nearest_plan(spec, hw, work, fixed, runtime, why_pinned_fails(result))
    where = f"parallel {_fmt_fixed(fixed)} on {hw.describe()}"
    if not result.candidates:
        raise UserError(f"{where}: no plan has these degrees (TP x PP x DP must equal "
                        f"{hw.world_size} devices, EP must divide {spec.num_experts} experts)")
    over = [c for c in result.candidates if c.memory is not None]
    if not over:
        raise UserError(f"{where}: {result.candidates[0].rejected}")
    closest = min(over, key=lambda c: c.breakdown.over_by())
    raise UserError(f"{where} is infeasible: {closest.label()} {closest.rejected}")


def why_pinned_fails(result: PlanResult) -> str:
    """The reason the closest pinned candidate was rejected (memory first, else the rule)."""
    over = [c for c in result.candidates if c.memory is not None]
    if over:
        closest = min(over, key=lambda c: c.breakdown.over_by())
        return f"{closest.label()} {closest.rejected}"
    if result.candidates:
        return result.candidates[0].rejected or "rejected"
    return f"no plan has these degrees on {result.hardware.world_size} devices"


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
            res.notes.append(f"pinned {_fmt_fixed(fixed)} cannot run ({why}); nearest runnable "
                             f"plan replaces {got}")
            return res
    if work.mode == "lora" and work.seq_len // 2 >= min_seq:
        shorter = Workload(**{**work.__dict__, "seq_len": work.seq_len // 2})
        unpinned = why_pinned_fails(res) if res else why  # with every pin released
        res = plan_with_degrees(spec, hw, shorter, {_long(k): v for k, v in fixed.items()},
                                runtime, policy="nearest")
        res.notes.insert(0, f"seq_len {work.seq_len} fits no plan on {hw.name} (closest: {unpinned}); "
                            f"planned at seq_len {res.work.seq_len}: finetune trains at it")
        return res
    raise UserError(f"parallel {_fmt_fixed(fixed)} on {hw.describe()}: nothing runs near it ({why})")


def _long(short: str) -> str:
    return next(k for k, v in DEGREE_KEYS.items() if v == short)


def _fmt_fixed(fixed: dict[str, int]) -> str:
    return " ".join(f"{k.upper()}={v}" for k, v in fixed.items())


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
        "alternatives": [_row(c) for c in result.feasible[1:top + 1]],
        "rejected": result.rejected_summary(),
        "notes": result.notes,
    }


def _row(c: Candidate) -> dict:
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
    return [_row(c) for c in feas + mem_fail]


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
    return msg


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


def plan_from_record(plan: dict) -> Plan:
    """Plan degrees from a plan record / plan.json dict."""
    try:  # records written before context parallelism have no CP degree: 1
        return Plan(**{short: int(plan[long] if long != "context_parallel"
                                  else plan.get(long) or 1) for long, short in DEGREE_KEYS.items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"plan record lacks a valid degree: {exc}") from None
