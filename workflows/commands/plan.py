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

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from moeflow.errors import UserError
from workflows.printer import make_console, styled

REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "configs" / "models"


def _resolve_model(arg: str) -> Path:
    path = Path(arg)
    if path.exists():
        return path
    named = MODELS_DIR / f"{arg}.json"
    if named.is_file():
        return named
    known = ", ".join(sorted(p.stem for p in MODELS_DIR.glob("*.json")))
    raise UserError(f"{arg}: no such config.json, checkpoint dir or pipeline YAML; "
                    f"shipped model configs: {known}")


def _inputs(model_or_config: str, o: dict):
    """(spec, model path, hardware, workload, degrees, runtime, alternatives) from args."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.config import load_config
    from moeflow.hardware import load_hardware
    from moeflow.memory import Workload
    from moeflow.params import spec_from_path
    from tasks.plan import plan_source, workload_from_config

    path = _resolve_model(model_or_config)
    if path.suffix in (".yaml", ".yml"):
        cfg = load_config(path)
        model_path, work = plan_source(cfg), workload_from_config(cfg)
        hw_name, nodes, runtime = cfg.hardware.spec, cfg.hardware.nodes, cfg.plan.runtime
        degrees, o["policy"] = cfg.parallel.degrees(), cfg.plan.explicit
    else:
        model_path, work, hw_name, nodes, runtime = str(path), Workload(), "cpu-local", None, "transformers"
        degrees = {}
    changes = {k: v for k, v in o["work"].items() if v is not None}
    work = Workload(**{**work.__dict__, **changes})
    degrees.update({k: v for k, v in o["degrees"].items() if v is not None})
    hw = load_hardware(o["hardware"] or hw_name, o["nodes"] or nodes)
    return spec_from_path(model_path), model_path, hw, work, degrees, o["runtime"] or runtime


def _vllm_plan(spec, hw, work, degrees: dict) -> dict | None:
    """The vLLM serving sub-plan of a pipeline YAML (pinned degrees apply to inference plans)."""

    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.vllm_plan import vllm_serving_plan

    return vllm_serving_plan(spec, hw, replace(work, mode="inference"), "auto",
                             degrees if work.mode == "inference" else None)


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:.0f}"


def _print_report(console: Console, result, record: dict | None) -> None:
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.memory import human
    from moeflow.params import count_params
    from moeflow.planner import weights_alone

    c, hw, w = count_params(result.spec), result.hardware, result.work
    wa = weights_alone(result.spec, hw, w.weight_dtype)
    console.print(styled(result.spec.family, "bold"), f": {_count(c.total)} parameters "
                  f"({_count(c.active)} active per token, vision {_count(c.vision)}); "
                  f"weights {human(wa['bytes'])} in {wa['dtype']} ({wa['of_bf16']:.2f}x of bf16) = "
                  f"{wa['devices']} x {hw.memory_per_device_gb:g} GB devices for weights alone", sep="")
    console.print(f"hardware: {hw.describe()}; mode {w.mode}; runtime {result.runtime}")
    best = result.best
    if best:
        console.print(styled(f"best plan: {best.label()}", "bold"), f" ({best.plan.world} workers)", sep="")
        console.print(_layout_table(best, w))
        mem = Table()
        mem.add_column("per device")
        mem.add_column("bytes", justify="right")
        for part, v in best.memory.parts.items():
            mem.add_row(part, human(v))
        mem.add_row(styled("total", "bold"), styled(human(best.memory.total), "bold"))
        mem.add_row("budget", human(best.memory.budget))
        console.print(mem)
        console.print("cost: " + ", ".join(f"{k}={v:.4g}" for k, v in best.cost.items()))
    _print_alternatives(console, result)
    rej = Table(title="why the other plans were rejected")
    rej.add_column("plans", justify="right")
    rej.add_column("reason")
    for reason, n in result.rejected_summary().items():
        rej.add_row(str(n), reason)
    console.print(rej)
    for note in result.notes:
        console.print(f"note: {note}")


def _layout_table(best, work) -> Table:
    """The chosen degrees in one row, with what a LoRA plan does about its activations."""
    t = Table()
    p, w = best.plan, best.work or work
    cols = {"TP": p.tp, "PP": p.pp, "EP": p.ep, "DP": p.dp, "FSDP": p.fsdp}
    if w.mode == "lora":
        cols.update({"CP": p.cp, "recompute": "yes" if w.recompute else "no", "seq_len": w.seq_len})
    for name in cols:
        t.add_column(name, justify="right")
    t.add_row(*(str(v) for v in cols.values()))
    return t


def _print_alternatives(console: Console, result) -> None:
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.memory import human
    from moeflow.planner import alternatives_table

    rows = alternatives_table(result, limit=8)
    if not rows:
        return
    t = Table(title="plans ranked (then the closest that do not fit)")
    for col in ("plan", "memory/device", "tokens/s", "rejected"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["plan"], human(r.get("memory_gb", 0) * 1e9),
                  f"{r.get('throughput_tok_s', 0):,.1f}" if r.get("throughput_tok_s") else "-",
                  (r["rejected"] or "")[:90])
    console.print(t)


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
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.planner import infeasible_message, plan_record, plan_with_degrees

    targets = tuple(s.strip() for s in lora_targets.split(",") if s.strip()) if lora_targets else None
    opts: dict[str, Any] = {"hardware": hardware, "nodes": nodes, "runtime": runtime,
            "work": dict(mode=mode, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                         recompute=recompute, lora_rank=lora_rank, lora_targets=targets, batch=batch,
                         context=context, weight_dtype=weight_dtype, kv_dtype=kv_dtype),
            "degrees": {"tensor_parallel": tp, "pipeline_parallel": pp, "expert_parallel": ep,
                        "data_parallel": dp, "fsdp": fsdp, "context_parallel": cp}}
    spec, model_path, hw, work, degrees, rt = _inputs(model_or_config, opts)
    result = plan_with_degrees(spec, hw, work, degrees, rt, policy=opts.get("policy", "strict"))
    record = plan_record(result, model_path) if result.best else None
    if record is not None and "policy" in opts:  # a pipeline YAML: also what the vllm backend serves
        record["serving_vllm"] = _vllm_plan(spec, hw, work, degrees)
    console = make_console()
    if as_json:
        payload = record or {"feasible": False, "message": infeasible_message(result),
                             "smallest_hardware": result.smallest, "notes": result.notes,
                             "rejected": result.rejected_summary()}
        print(json.dumps(payload, indent=2, default=str))
    else:
        _print_report(console, result, record)
        if record and record.get("serving_vllm"):
            v = record["serving_vllm"]
            console.print(styled(f"serving (vllm backend): TP{v['tensor_parallel']} PP{v['pipeline_parallel']} "
                                 f"EP{v['expert_parallel']} DP{v['data_parallel']}", "bold"), " = engine DP "
                          f"{v['data_parallel_size']} x {v['num_replicas']} replica(s) of "
                          f"{v['devices_per_replica']} devices, {v['weight_dtype']} weights ({v['why_dtype']})", sep="")
    if out and record:
        tmp = Path(out).with_name(Path(out).name + ".tmp")
        tmp.write_text(json.dumps(record, indent=2, default=str))
        tmp.replace(out)
    if record is None:
        if not as_json:
            console.print(infeasible_message(result), style="red")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command(name="plan")(plan)
