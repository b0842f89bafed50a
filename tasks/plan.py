"""Stage `plan`: count parameters, do the memory math, pick TP x PP x EP x DP.

Reads config.json of the converted checkpoint (else `model.path`) and the
hardware spec, searches every parallel plan (moeflow/parallel/planner.py), writes
`plan.json` (the degrees finetune and deploy apply), `alternatives.json` and a
memory-breakdown chart, and logs them to MLflow when a run is active.

    moeflow run configs/demo.yaml --stages plan     (through the pipeline, alone)
    moeflow plan demo-work/model --hardware cpu-local --mode lora   (alone)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.model.params import spec_from_path
from moeflow.parallel.memory import Workload, planned_rank_bytes
from moeflow.parallel.planner import PlanResult, alternatives_table, plan_from_record, plan_record, plan_with_degrees
from moeflow.parallel.vllm_plan import vllm_engine, vllm_serving_plan
from moeflow.parallel.workload import backend_choice, plan_source
from moeflow.parallel.workload import local_workload as local_workload  # callers import it from here
from moeflow.parallel.workload import workload_from_config as config_workload
from tasks.base import StageContext, StageSpec

MAX_RANKS_LISTED = 64  # plan.json lists every rank's planned bytes up to this world size


def workload_from_config(cfg: PipelineConfig) -> Workload:
    """The planner's workload from the config (moeflow.parallel.workload), a calibrated
    checkpoint's dtype taken from its scheme."""
    calibrated = None
    if cfg.deploy.weights == "calibrated":
        from moeflow.quant.schemes import get_scheme  # serving the calibrate stage's checkpoint

        calibrated = get_scheme(cfg.calibrate.scheme).storage_dtype
    return config_workload(cfg, calibrated)


def model_dir(ctx: StageContext) -> str:
    """Where config.json is: the converted checkpoint when convert ran, else `plan_source`."""
    converted = ctx.inputs.get("convert", {}).get("output_dir")
    return str(converted or plan_source(ctx.config))


def rank_bytes(result: PlanResult, record: dict, dtype: str) -> dict[str, int]:
    """Planned parameter bytes per rank in the load dtype (first rank of each stage
    beyond MAX_RANKS_LISTED ranks)."""

    plan = plan_from_record(record)
    ranks = (range(plan.world) if plan.world <= MAX_RANKS_LISTED
             else range(0, plan.world, plan.tp * plan.dp))
    return {str(r): planned_rank_bytes(result.spec, plan, r, dtype) for r in ranks}


def memory_chart(result: PlanResult, path: Path, limit: int = 8):
    """Stacked bars: per-device memory parts of the best plans vs the device budget."""
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib

    matplotlib.use("Agg")  # headless: no display in Ray workers
    import matplotlib.pyplot as plt

    cands = result.feasible[:limit] or sorted(
        (c for c in result.candidates if c.memory), key=lambda c: c.breakdown.over_by())[:limit]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cands) + 2), 4.5))
    parts = list(cands[0].breakdown.parts) if cands else []
    bottom = [0.0] * len(cands)
    for part in parts:
        vals = [c.breakdown.parts.get(part, 0) / 1e9 for c in cands]
        ax.bar([c.label() for c in cands], vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(result.hardware.memory_per_device_gb, color="red", linestyle="--",
               label=f"device {result.hardware.memory_per_device_gb:g} GB")
    ax.set_ylabel("GB per device")
    ax.set_title(f"{result.spec.family} on {result.hardware.name} ({result.work.mode})")
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def _log_mlflow(record: dict, plan_path: Path, alt_rows: list[dict], fig) -> None:
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.log_artifact(str(plan_path), artifact_path="plan")
    mlflow.log_table({k: [r.get(k) for r in alt_rows] for k in alt_rows[0]} if alt_rows else {},
                     artifact_file="plan/alternatives.json")
    mlflow.log_figure(fig, "plan/memory_breakdown.png")
    mlflow.log_metrics({
        "plan.num_workers": record["num_workers"],
        "plan.memory_per_device_gb": record["memory"]["total_gb"],
        "plan.throughput_tok_s": record["cost"]["throughput_tok_s"],
        "plan.params_total": record["model"]["total"],
        "plan.params_active": record["model"]["active"],
        "plan.weights_tb": record["model"]["weights"]["tb"],
    })


def run(ctx: StageContext) -> dict:
    """Plan the parallel strategy; returns {"plan_path", "plan": {degrees, mode, ...}}."""
    cfg = ctx.config
    src = model_dir(ctx)
    spec = spec_from_path(src)
    hw = load_hardware(cfg.hardware.spec, cfg.hardware.nodes)
    result = plan_with_degrees(spec, hw, workload_from_config(cfg), cfg.parallel.degrees(),
                               cfg.plan.runtime, policy=cfg.plan.explicit)
    record = plan_record(result, src, top=cfg.plan.alternatives)
    record["planned_rank_bytes"] = rank_bytes(result, record, cfg.model.dtype)
    record["load_dtype"] = cfg.model.dtype
    plan_path = ctx.write_json("plan.json", record)
    alt_rows = alternatives_table(result)
    ctx.write_json("alternatives.json", alt_rows)
    chart = ctx.out_dir / "memory_breakdown.png"
    fig = memory_chart(result, chart)
    _log_mlflow(record, plan_path, alt_rows, fig)
    keys = ("num_workers", "tensor_parallel", "pipeline_parallel", "expert_parallel",
            "data_parallel", "fsdp", "context_parallel", "recompute", "mode", "runtime",
            "data_parallel_impl", "distributed_config", "load_dtype")
    summary = {k: record[k] for k in keys}
    summary["seq_len"] = record["workload"]["seq_len"]  # differs from data.seq_len only if notes say so
    summary["notes"] = record["notes"]
    summary.update(memory_per_device_gb=record["memory"]["total_gb"],
                   planned_rank_bytes=record["planned_rank_bytes"], hardware=hw.name,
                   serving=serving_plan(cfg, spec, hw, result, src))
    return {"plan_path": str(plan_path), "plan": summary, "chart": str(chart),
            "alternatives_path": str(ctx.out_dir / "alternatives.json")}


def serving_plan(cfg: PipelineConfig, spec, hw, result: PlanResult, src: str) -> dict | None:
    """The inference plans deploy applies: the local backend's (replicas = its DP degree, on
    plan.runtime) and, under "vllm", the vllm backend's TP x PP x EP x DP; "backend": the
    one that serves (deploy.backend, auto resolved) and why."""
    choice = backend_choice(cfg, spec, hw)
    chosen = {"backend": choice["backend"], "backend_why": choice["why"], "local_fits": choice["local_fits"],
              "local_memory_gb": round(choice["local_memory_bytes"] / 1e9, 3),
              "device_gb": round(choice["device_bytes"] / 1e9, 3)}
    if result.work.mode != "inference":
        result = plan_with_degrees(spec, hw, replace(workload_from_config(cfg), mode="inference"),
                                   {}, cfg.plan.runtime)
    inference = replace(workload_from_config(cfg), mode="inference")
    # an inference plan's pinned degrees pin the vLLM sub-plan too (a LoRA plan's do not)
    pins = cfg.parallel.degrees() if cfg.plan.mode == "inference" else {}
    vllm = vllm_serving_plan(spec, hw, inference, cfg.plan.serving_weight_dtype, pins, cfg.deploy.dtype,
                             vllm_engine(cfg.deploy, src))
    try:
        rec = plan_record(result, src, top=0)
    except UserError:
        return {"vllm": vllm, **chosen}
    return {**chosen, "num_replicas": rec["data_parallel"], "tensor_parallel": rec["tensor_parallel"],
            "pipeline_parallel": rec["pipeline_parallel"], "expert_parallel": rec["expert_parallel"],
            "memory_per_device_gb": rec["memory"]["total_gb"], "runtime": result.runtime,
            "vllm": vllm}


def _preflight(cfg: PipelineConfig) -> None:
    load_hardware(cfg.hardware.spec, cfg.hardware.nodes)  # a bad spec fails before anything runs
    source = plan_source(cfg)  # refuses a plan.architecture that does not exist
    if not Path(source).exists():
        raise UserError(f"model path not found: {cfg.model.path} (model.path; set plan.architecture "
                        f"to plan without the checkpoint)")


STAGE = StageSpec(
    name="plan",
    run=run,
    after=("convert",),  # the converted checkpoint's config when convert runs; else plan_source
    sections=("model", "hardware", "parallel", "lora", "data", "plan"),
    fingerprint=("hardware.spec",),  # reads the hardware YAML; the model via convert's record
    preflight=_preflight,
    needs_model=False,  # plans from plan.architecture while model.path does not exist
    description="parameter counts, per-device memory and the TP x PP x EP x DP plan",
)
