"""The cost model: seconds of compute and communication of a plan on a hardware spec.

Used by the planner to rank plans and by the dry run to price the stages that run them.
All constants are named here; a ranking aid, not a promise.

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
  prefill (TTFT), `prefill_seconds`: chunks of the prompt pipelined through the stages.
Every collective pays ALPHA_INTRA inside a node or ALPHA_INTER across nodes.

    python -c "from moeflow.parallel.cost import flops_per_token"   # library
"""

from __future__ import annotations

import math

from moeflow.core.hardware import GB, HardwareSpec
from moeflow.model.params import EXPERT_KINDS, ModelSpec, ParamCount, count_params
from moeflow.parallel.memory import Breakdown, Plan, Workload, dtype_bytes, lora_numel, lora_targets, stage_layers

MFU = 0.4  # fraction of peak FLOP/s a tuned MoE kernel stack sustains
ALPHA_INTRA = 5e-6  # seconds of latency per collective inside a node
ALPHA_INTER = 15e-6  # ... across nodes


def alpha(hw: HardwareSpec, span: int) -> float:
    """Fixed latency of one collective over `span` devices."""
    return ALPHA_INTRA if span <= hw.devices_per_node else ALPHA_INTER


def allreduce(hw: HardwareSpec, n: int, nbytes: float, span: int) -> float:
    """Ring all-reduce time of `nbytes` over `n` ranks spanning `span` devices."""
    if n <= 1:
        return 0.0
    return alpha(hw, span) + 2 * (n - 1) / n * nbytes / hw.link_bandwidth(span)


def alltoall(hw: HardwareSpec, n: int, nbytes: float, span: int) -> float:
    """All-to-all time when each rank holds `nbytes` and keeps 1/n of them."""
    if n <= 1:
        return 0.0
    return alpha(hw, span) + (n - 1) / n * nbytes / hw.link_bandwidth(span)


def flops_per_token(spec: ModelSpec, counts: ParamCount, seq: int) -> float:
    """Forward FLOPs of one token: 2 per active matmul parameter + causal attention."""
    matmul = counts.active - counts.active_by_kind.get("embed", 0)
    if spec.tie_embeddings:  # the tied embedding is also the head matmul
        matmul += counts.active_by_kind.get("embed", 0)
    return 2 * matmul + 2 * seq * spec.heads * spec.head_dim * spec.layers


def active_flops(counts: ParamCount, tokens: float) -> float:
    """Forward FLOPs of `tokens` tokens at 2 per active parameter (no attention term)."""
    return 2 * counts.active * tokens


def decode_floor_seconds(counts: ParamCount, hw: HardwareSpec, steps: float) -> float:
    """Decode steps bound by reading the active weights (bf16) from HBM once each."""
    return steps * 2 * counts.active / (hw.hbm_bandwidth_gbs * GB)


def lora_params_on_rank(spec: ModelSpec, p: Plan, work: Workload) -> float:
    """LoRA parameters one rank holds: the adapters shard like the modules they adapt."""
    total = sum(lora_numel(t, work.lora_rank) for t in lora_targets(spec, work.lora_targets))
    return total / (p.pp * max(1, p.tp) * (p.fsdp if p.fsdp > 1 else 1))


def lora_cost(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload, counts: ParamCount,
              lora_rank_params: float, mem: Breakdown) -> dict[str, float]:
    """Seconds per optimizer step and tokens/s of a LoRA plan (module docstring)."""
    H, m = spec.hidden, max(1, work.grad_accum)
    T = work.micro_batch * work.seq_len / p.cp  # tokens per rank: CP splits each sequence
    passes = 3 if work.recompute is not False else 2
    first = stage_layers(spec.layers, p.pp, 0)  # the largest stage sets the pace
    L, moe_l = len(first), len(set(first) & set(spec.moe_layers))
    compute = T * flops_per_token(spec, counts, work.seq_len) * passes / (
        p.tp * p.pp * hw.peak_flops("bf16") * MFU)
    act = T * H * dtype_bytes(work.act_dtype)
    tp = L * 2 * passes * allreduce(hw, p.tp, act, p.tp)
    ep = moe_l * 2 * passes * alltoall(hw, p.ep, act * spec.experts_per_tok, p.ep)
    # a rank holding 1/f of a tensor receives the other (f - 1)/f of it per gather
    gathered = (mem.parts["weights_dense"] * (p.fsdp - 1)
                + mem.parts["weights_experts"] * (p.efsdp - 1))
    fsdp = 0.0 if p.fsdp <= 1 else passes * (
        alpha(hw, p.tp * p.fsdp) * L + gathered / hw.link_bandwidth(p.tp * p.fsdp))
    p2p = 0.0 if p.pp <= 1 else 2 * (alpha(hw, p.world) + act / hw.link_bandwidth(p.tp * p.dp * 2))
    qkvo = T * (2 * spec.heads + 2 * spec.kv_heads) * spec.head_dim / p.tp * dtype_bytes(work.act_dtype)
    cp = 0.0 if p.cp <= 1 else L * passes * 4 * alltoall(hw, p.cp, qkvo / 4, p.tp * p.cp)
    t_mb = compute + tp + ep + fsdp + p2p + cp
    dp = allreduce(hw, p.dp, 4 * lora_rank_params, p.tp * p.dp)
    step = (m + p.pp - 1) * t_mb + dp
    return {"step_s": step, "compute_s": m * compute, "tp_comm_s": m * tp, "ep_comm_s": m * ep,
            "fsdp_comm_s": m * fsdp, "pp_bubble_s": (p.pp - 1) * t_mb, "pp_p2p_s": m * p2p,
            "cp_comm_s": m * cp, "dp_comm_s": dp, "throughput_tok_s": p.dp * m * T / step}


def inference_cost(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload, counts: ParamCount,
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
    comm = (L * 2 * allreduce(hw, p.tp, act, p.tp)
            + moe_l * 2 * alltoall(hw, p.ep, act * k, p.ep)
            + (0.0 if p.pp <= 1 else alpha(hw, p.world) + act / hw.link_bandwidth(p.world)))
    tpot = p.pp * (t_stage + comm)
    prompt = work.context * flops_per_token(spec, counts, work.context) / (
        p.tp * p.pp * hw.peak_flops(dtype) * MFU)
    return {"tpot_s": tpot, "decode_read_bytes": read, "experts_touched": touched,
            "comm_s": p.pp * comm, "ttft_s": prompt + p.pp * comm,
            "throughput_tok_s": p.dp * B / tpot}


def prefill_seconds(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload, mem: Breakdown,
                    counts: ParamCount | None = None) -> float:
    """TTFT of one `work.context`-token prompt arriving alone at an engine of plan `p`.

    The prompt is prefilled in C = ceil(context / prefill_chunk) chunks that flow through
    the PP stages one after another (chunked prefill), so it takes (C + PP - 1) chunk-steps
    of one stage. A chunk-step on one stage is the larger of
      compute: chunk tokens x forward FLOPs of the stage's layers (flops_per_token) at
               peak x MFU, the routed experts' share spread over max(TP, EP) devices (a
               lone prompt's tokens reach every EP rank), the rest over the TP ranks, and
      weights: the stage's weights read from HBM once (thousands of tokens touch every expert),
    plus its collectives: 2 TP all-reduces per layer and an EP dispatch + combine per MoE layer
    of the chunk's activations, and the hop to the next stage -- the decode terms
    (module docstring) at chunk size instead of batch size.
    """
    counts = counts or count_params(spec)
    chunk = min(work.context, work.prefill_chunk)
    chunks = math.ceil(work.context / chunk)
    dtype = "fp8" if work.weight_dtype == "fp8" else "bf16"
    expert = 2 * sum(counts.active_by_kind.get(k, 0) for k in EXPERT_KINDS)
    rest = flops_per_token(spec, counts, work.context) - expert
    flops = chunk * (rest / p.tp + expert / max(p.tp, p.ep)) / p.pp
    weights = mem.parts["weights_dense"] + mem.parts["weights_experts"]
    compute = max(flops / (hw.peak_flops(dtype) * MFU), weights / (hw.hbm_bandwidth_gbs * GB))
    act = chunk * spec.hidden * dtype_bytes(work.act_dtype)
    layers, moe = math.ceil(spec.layers / p.pp), math.ceil(len(spec.moe_layers) / p.pp)
    comm = (layers * 2 * allreduce(hw, p.tp, act, p.tp)
            + moe * 2 * alltoall(hw, p.ep, act * spec.experts_per_tok, p.ep)
            + (0.0 if p.pp <= 1 else act / hw.link_bandwidth(p.world)))
    return (chunks + p.pp - 1) * (compute + comm)
