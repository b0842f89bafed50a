"""A pipeline config in the planner's terms: the workload it plans, the local engine's
workload, which backend serves, where the architecture is read from, and what deploy (and the
serving search) would run. The plan stage (tasks/plan.py) and the dry run (workflows/dryrun.py)
both read a config through these.

    python -c "from moeflow.parallel.workload import workload_from_config"   # library
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.core.hardware import HardwareSpec
from moeflow.model.params import ModelSpec
from moeflow.parallel.memory import Workload
from moeflow.parallel.planner import plan_with_degrees
from moeflow.parallel.vllm_plan import choose_backend, local_replica, vllm_engine, vllm_serving_plan

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"  # shipped architectures


def workload_from_config(cfg: PipelineConfig, calibrated_dtype: str | None = None) -> Workload:
    """The planner's workload from the `plan:`, `data:`, `lora:` and `model:` sections.

    Args:
        calibrated_dtype: the calibrate scheme's storage dtype (moeflow.quant.schemes), which an
            inference plan with plan.weight_dtype auto holds when deploy.weights is calibrated.
    """
    p = cfg.plan
    weight = DTYPES[cfg.model.dtype] if p.weight_dtype == "auto" else p.weight_dtype
    if p.weight_dtype == "auto" and p.mode == "inference" and cfg.deploy.weights == "calibrated":
        if calibrated_dtype is None:
            raise ValueError("deploy.weights calibrated: pass the calibrate scheme's storage dtype")
        weight = calibrated_dtype
    return _workload(cfg, weight)


def _workload(cfg: PipelineConfig, weight: str) -> Workload:
    p = cfg.plan
    return Workload(mode=p.mode, seq_len=cfg.data.seq_len, micro_batch=p.micro_batch_size,
                    grad_accum=p.grad_accum, recompute=None if p.recompute == "auto" else p.recompute,
                    lora_rank=cfg.lora.rank,
                    lora_targets=tuple(cfg.lora.target_modules), batch=p.batch,
                    context=p.context, prefill_chunk=p.prefill_chunk, weight_dtype=weight,
                    kv_dtype=p.kv_dtype)


def local_workload(cfg: PipelineConfig, hw: HardwareSpec) -> Workload:
    """The inference workload of moeflow's local engine: weights and KV cache in the dtype it
    computes in (deploy.dtype; auto: bf16 on an accelerator, fp32 on a CPU spec's cores)."""
    cpu = "cpu" in (hw.accelerator or "").lower()
    dtype = DTYPES.get(cfg.deploy.dtype) or ("fp32" if cpu else "bf16")
    return replace(_workload(cfg, dtype), mode="inference", kv_dtype=dtype)


def backend_choice(cfg: PipelineConfig, spec: ModelSpec, hw: HardwareSpec) -> dict:
    """Which backend deploy (and the serving search) uses: moeflow.parallel.vllm_plan.choose_backend."""
    return choose_backend(cfg.deploy.backend, spec, hw, local_workload(cfg, hw))


def plan_source(cfg: PipelineConfig) -> str:
    """model.path, or plan.architecture (a config.json path or a configs/models name) while
    model.path does not exist: planning needs the architecture only."""
    if Path(cfg.model.path).exists() or not cfg.plan.architecture:
        return cfg.model.path
    named = MODELS_DIR / f"{cfg.plan.architecture}.json"
    path = Path(cfg.plan.architecture)
    if not path.exists() and named.is_file():
        return str(named)
    if not path.exists():
        raise UserError(f"plan.architecture: {path} does not exist (nor configs/models/{path.name}.json)")
    return str(path)


def serving_inputs(cfg: PipelineConfig, spec: ModelSpec, hw: HardwareSpec, work: Workload) -> dict[str, Any]:
    """What deploy serves and what the serving search brings up: the backend (deploy.backend,
    auto resolved as the plan stage does), replicas, devices, memory per device and the cost
    model's TPOT / TTFT / tokens/s; "search": one candidate of the serving search -- a local
    engine replica set, or a vLLM engine of the vLLM plan's layout when vLLM serves.

    Args:
        work: the inference workload (workload_from_config with mode inference).
    """
    choice = backend_choice(cfg, spec, hw)
    knobs = {"batch": work.batch, "context": work.context, "max_num_seqs": cfg.deploy.max_num_seqs,
             "backend": choice["backend"], "backend_why": choice["why"]}
    if choice["backend"] == "local":
        local = _local_serving(cfg, spec, hw, work)
        return {**knobs, **local, "search": local}
    why: list[str] = []
    v = vllm_serving_plan(spec, hw, work, cfg.plan.serving_weight_dtype, {}, cfg.deploy.dtype,
                          vllm_engine(cfg.deploy, plan_source(cfg)), reasons=why)
    if not v:
        return {**knobs, "unfit": f"deploy ({choice['why']}): no vLLM plan fits {hw.describe()}"
                                  + (f" ({'; '.join(why)})" if why else ""), "search": {}}
    engine = {"replicas": cfg.deploy.num_replicas or v["num_replicas"],
              "devices_per_replica": v["devices_per_replica"], "engines_per_replica": v["data_parallel_size"],
              "layout": f"vLLM TP{v['tensor_parallel']} PP{v['pipeline_parallel']} "
                        f"EP{v['expert_parallel']} DP{v['data_parallel_size']}, {v['weight_dtype']}",
              "memory_bytes": v["memory_per_device_gb"] * 1e9, "tpot_s": v["tpot_s"],
              "ttft_s": v["ttft_s"], "tok_s": v["throughput_tok_s"] / v["num_replicas"]}
    return {**knobs, **engine, "search": engine}


def _local_serving(cfg: PipelineConfig, spec: ModelSpec, hw: HardwareSpec, work: Workload) -> dict[str, Any]:
    """Replicas of moeflow's local engine: each holds the model on one device
    (moeflow.core.devices.local_device): one GPU, or deploy.num_cpus cores where a device is a core."""
    local = local_replica(spec, hw, local_workload(cfg, hw))
    best = plan_with_degrees(spec, hw, work, {}, cfg.plan.runtime).best  # its DP: deploy's replicas
    per = math.ceil(cfg.deploy.num_cpus) if "cpu" in (hw.accelerator or "").lower() else 1
    return {"replicas": cfg.deploy.num_replicas or (best.plan.dp if best else 1),
            "devices_per_replica": per, "layout": "local engine, the whole model on one device",
            "memory_bytes": local["memory"].total, "tpot_s": local["tpot_s"], "ttft_s": local["ttft_s"],
            "tok_s": local["tok_s"]}
