"""`moeflow plan`: parameter counts, per-device memory and the best TP x PP x EP x DP plan.

    moeflow plan configs/models/mixtral-8x7b.json --hardware cluster/hardware/h100-80g-x8.yaml --mode lora
    moeflow plan deepseek-v3 --hardware h200-141g-x8 --nodes 2 --mode inference --batch 32 --context 8192
    moeflow plan reference-2.8t --hardware h100-80g-x8 --mode inference      # says how many nodes it needs
    moeflow plan configs/demo.yaml --json                                    # a pipeline config's plan

MODEL_OR_CONFIG is a config.json, a checkpoint dir, a name under configs/models/,
or a pipeline YAML (its model/hardware/parallel/lora/data/plan sections; flags win).
Exit codes: 0 a plan fits, 1 nothing fits (the smallest hardware that would is printed),
2 bad input.
"""

from __future__ import annotations

from typing import Any, Optional

import typer


def plan(
    model_or_config: str = typer.Argument(...,
                                          help="config.json, checkpoint dir, configs/models name, or pipeline YAML"),
    hardware: Optional[str] = typer.Option(None, help="cluster/hardware name or YAML path (default cpu-local)"),
    nodes: Optional[int] = typer.Option(None, min=1, help="override the spec's node count"),
    mode: Optional[str] = typer.Option(None, help="lora | inference"),
    seq_len: Optional[int] = typer.Option(None, min=1, help="lora: tokens per sequence"),
    micro_batch: Optional[int] = typer.Option(None, min=1, help="lora: sequences per DP rank per micro-batch"),
    grad_accum: Optional[int] = typer.Option(None, min=1, help="lora: micro-batches per step"),
    recompute: Optional[bool] = typer.Option(None, "--recompute/--no-recompute", help="activation recomputation"),
    lora_rank: Optional[int] = typer.Option(None, min=1, help="LoRA rank"),
    lora_targets: Optional[str] = typer.Option(None,
                                               help="comma list: attention,experts,shared_experts or module names"),
    batch: Optional[int] = typer.Option(None, min=1, help="inference: concurrent sequences per replica"),
    context: Optional[int] = typer.Option(None, min=1, help="inference: tokens cached per sequence"),
    weight_dtype: Optional[str] = typer.Option(None, help="bf16 | fp8 | int8 | fp32"),
    kv_dtype: Optional[str] = typer.Option(None, help="bf16 | fp8"),
    runtime: Optional[str] = typer.Option(None, help="transformers (its measured limits) | generic | vllm (serving)"),
    tp: Optional[int] = typer.Option(None, min=1, help="pin tensor parallel"),
    pp: Optional[int] = typer.Option(None, min=1, help="pin pipeline parallel"),
    ep: Optional[int] = typer.Option(None, min=1, help="pin expert parallel"),
    dp: Optional[int] = typer.Option(None, min=1, help="pin data parallel"),
    fsdp: Optional[int] = typer.Option(None, min=1, help="pin FSDP"),
    cp: Optional[int] = typer.Option(None, min=1, help="pin context parallel (lora)"),
    as_json: bool = typer.Option(False, "--json", help="print the plan record as JSON"),
    out: Optional[str] = typer.Option(None, help="also write plan.json here"),
):
    """Count parameters, do the memory math, and pick the TP x PP x EP x DP plan."""
    targets = tuple(s.strip() for s in lora_targets.split(",") if s.strip()) if lora_targets else None
    opts: dict[str, Any] = {"hardware": hardware, "nodes": nodes, "runtime": runtime,
            "work": dict(mode=mode, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                         recompute=recompute, lora_rank=lora_rank, lora_targets=targets, batch=batch,
                         context=context, weight_dtype=weight_dtype, kv_dtype=kv_dtype),
            "degrees": {"tensor_parallel": tp, "pipeline_parallel": pp, "expert_parallel": ep,
                        "data_parallel": dp, "fsdp": fsdp, "context_parallel": cp}}
    # lazy: what the command does loads the planner (torch-free, but pydantic, transformers'
    # config classes); `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import plan as action

    action.run(model_or_config, opts, as_json, out)


def register(app: typer.Typer) -> None:
    app.command(name="plan")(plan)
