"""What `moeflow plan` does (workflows/commands/plan.py declares what it takes): the plan of a
model or a pipeline YAML's model, printed or as JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from moeflow.core.config import load_config
from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.model.params import count_params, spec_from_path
from moeflow.parallel.memory import Workload, human
from moeflow.parallel.planner import (
    alternatives_table,
    infeasible_message,
    plan_record,
    plan_with_degrees,
    weights_alone,
)
from moeflow.parallel.vllm_plan import vllm_serving_plan
from tasks.plan import plan_source, workload_from_config
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

    return vllm_serving_plan(spec, hw, replace(work, mode="inference"), "auto",
                             degrees if work.mode == "inference" else None)


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:.0f}"


def _print_report(console: Console, result, record: dict | None) -> None:
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


def run(model_or_config: str, opts: dict[str, Any], as_json: bool, out: str | None) -> None:
    """Plan, print (or print JSON), write `out`; exit 1 when nothing fits."""
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
