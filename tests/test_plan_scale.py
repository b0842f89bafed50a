"""The planner at scale: the reference 2.8T config on the shipped 384-device super-node
(planned as written: TP 8, EP 16, seq_len 32768, with the recompute / CP it chose and why),
the vLLM runtime's serving sub-plan and its mapping onto vLLM's TP / EP / engine-DP / replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moeflow.core.config import load_config
from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.model.params import spec_from_path
from moeflow.parallel.memory import Plan, Workload
from moeflow.parallel.planner import evaluate, plan_with_degrees
from moeflow.parallel.vllm_plan import vllm_layout
from tasks.base import StageContext

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "configs" / "reference-2.8t.yaml"


def test_reference_config_plans_on_the_384_device_spec():
    import typer

    from workflows.commands.plan import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["plan", str(REFERENCE), "--json"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)
    assert rec["num_workers"] == 384 and rec["hardware"]["name"] == "supernode-384"
    assert rec["tensor_parallel"] == 8 and rec["expert_parallel"] == 16  # as written
    assert rec["workload"]["seq_len"] == 32768 and rec["recompute"] is True
    assert rec["context_parallel"] >= 1 and rec["memory"]["total_gb"] <= 128
    notes = " ".join(rec["notes"])
    assert "->" not in notes and "finetune trains at it" not in notes  # nothing replaced
    assert "seq_len 32768: activations" in notes and "recompute per layer" in notes
    table = CliRunner().invoke(app, ["plan", str(REFERENCE)]).output
    assert "recompute" in table and "CP" in table and "32768" in table
    v = rec["serving_vllm"]
    assert v["runtime"] == "vllm" and v["tensor_parallel"] * v["pipeline_parallel"] * v["data_parallel"] == 384
    assert v["data_parallel_size"] * v["num_replicas"] * v["tensor_parallel"] * v["pipeline_parallel"] == 384


def test_plan_stage_of_the_reference_config_records_the_vllm_sub_plan(tmp_path):
    """`moeflow run` up to the plan stage: the stage's function on the shipped config."""
    from tasks.plan import run

    cfg = load_config(REFERENCE)
    out = tmp_path / "plan"
    out.mkdir()
    res = run(StageContext(stage="plan", config=cfg, inputs={}, out_dir=out))
    plan = res["plan"]
    assert plan["num_workers"] == 384 and plan["tensor_parallel"] == 8 and plan["seq_len"] == 32768
    assert plan["recompute"] is True and plan["context_parallel"] >= 1
    vllm = plan["serving"]["vllm"]
    assert vllm["weight_dtype"] in ("bf16", "int8") and vllm["enable_expert_parallel"]
    assert json.loads(Path(res["plan_path"]).read_text())["hardware"]["nodes"] == 48
    # the finetune stage runs what the plan stage planned: the same checks before any worker
    from moeflow.training.driver import check_plan
    from moeflow.training.lora import Targets

    deg = check_plan(plan, Targets(modules=["model.layers.0.self_attn.q_proj"]))
    assert deg.num_workers == 384 and deg.tensor_parallel == 8 and deg.context_parallel == plan["context_parallel"]
    assert deg.distributed is not None and deg.distributed["fsdp_size"] in (1, deg.data_parallel)


def test_strict_pins_still_fail_and_bad_architecture_is_one_line(tmp_path):
    from tasks.plan import plan_source

    spec = spec_from_path(ROOT / "configs/models/reference-2.8t.json")
    hw = load_hardware("supernode-384")
    with pytest.raises(UserError, match="TP=3 does not divide 64 attention heads"):
        plan_with_degrees(spec, hw, Workload(seq_len=4096, lora_rank=64), {"tensor_parallel": 3})
    cfg = load_config(REFERENCE, ["plan.architecture=no-such-model"])
    with pytest.raises(UserError, match="plan.architecture: no-such-model does not exist"):
        plan_source(cfg)


def test_vllm_layout_maps_ep_onto_engine_data_parallel():
    # DeepSeek-style: TP 8 x 2 nodes, EP 16 = TP x engine DP 2, one replica
    assert vllm_layout(Plan(tp=8, pp=1, ep=16, dp=2, fsdp=1)) == {
        "tensor_parallel_size": 8, "pipeline_parallel_size": 1, "enable_expert_parallel": True,
        "data_parallel_size": 2, "num_replicas": 1, "devices_per_replica": 16}
    lay = vllm_layout(Plan(tp=8, pp=2, ep=8, dp=4, fsdp=1))  # EP inside TP: 4 independent replicas
    assert (lay["data_parallel_size"], lay["num_replicas"], lay["devices_per_replica"]) == (1, 4, 16)
    lay = vllm_layout(Plan(tp=1, pp=1, ep=1, dp=2, fsdp=1))
    assert (lay["enable_expert_parallel"], lay["num_replicas"]) == (False, 2)


def test_vllm_runtime_serves_only():
    spec = spec_from_path(ROOT / "configs/models/deepseek-v3.json")
    hw = load_hardware("h100-80g-x8", nodes=2)
    c = evaluate(spec, hw, Plan(tp=8, pp=1, ep=16, dp=2, fsdp=1), Workload(mode="lora"), "vllm")
    assert "vllm runtime serves" in c.rejected
    c = evaluate(spec, hw, Plan(tp=8, pp=1, ep=16, dp=2, fsdp=1),
                 Workload(mode="inference", weight_dtype="fp8"), "vllm")
    assert c.rejected is None and c.memory.total < 80e9


def test_activation_remedies_recompute_then_context_parallel():
    """A sequence that does not fit: recompute first; pinning recompute off makes the planner
    split the sequence (CP) instead; a hybrid linear-attention model refuses CP in one line."""
    from dataclasses import replace

    from moeflow.parallel.planner import search

    spec = spec_from_path(ROOT / "configs/models/reference-2.8t.json")
    hw = load_hardware("supernode-384")
    fixed = {"tp": 8, "ep": 16}
    work = Workload(seq_len=32768, lora_rank=64, lora_targets=("attention",))
    auto = search(spec, hw, work, fixed=fixed, find_smallest=False).best
    assert auto.work.recompute and auto.plan.cp == 2  # recompute alone: 158 GB > 128
    no_rc = search(spec, hw, replace(work, seq_len=4096, recompute=False), fixed=fixed,
                   find_smallest=False)
    assert no_rc.best is not None and no_rc.best.plan.cp > 1 and not no_rc.best.work.recompute
    # CP divides every activation: the same plan's activations at CP=2 are half of CP=1's
    one = evaluate(spec, hw, replace(auto.plan, cp=1), replace(work, recompute=True))
    two = evaluate(spec, hw, replace(auto.plan, cp=2), replace(work, recompute=True))
    assert one.rejected and "activations" in one.rejected and two.rejected is None
    acts = [c.memory.parts["activations"] for c in (one, two)]
    assert acts[1] < 0.6 * acts[0]
    hybrid = replace(spec, linear_attention_layers=3)
    c = evaluate(hybrid, hw, replace(auto.plan, cp=2), work)
    assert c.rejected and "linear-attention" in c.rejected
