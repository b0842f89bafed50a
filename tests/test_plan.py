"""Memory math and the plan search: exact per-rank bytes, KV/precision math,
real-model plans, cpu-local plans the finetune stage can run, explicit degrees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.model.params import count_params, load_config_json, model_spec, spec_from_path
from moeflow.parallel.memory import (
    Plan,
    Workload,
    chunk_size,
    kv_bytes_per_token,
    memory_for_plan,
    planned_rank_bytes,
    planned_rank_numel,
    stage_layers,
)
from moeflow.parallel.planner import expected_rank_bytes, plan_record, plan_with_degrees, search, weights_alone

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"


@pytest.fixture(scope="module")
def tiny_cfg() -> dict:
    from moeflow_testing.tiny import debug_config

    return debug_config("qwen3_moe").to_dict()


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return model_spec(tiny_cfg)


def test_chunk_size_is_torch_chunk():
    import torch

    for n in (1, 5, 7, 8, 64, 100):
        for k in (1, 2, 3, 4, 8):
            pieces = [p.shape[0] for p in torch.chunk(torch.empty(n), k)]
            pieces += [0] * (k - len(pieces))
            assert [chunk_size(n, k, i) for i in range(k)] == pieces


def test_stage_layers_cover_every_layer_once():
    for L, pp in ((61, 8), (48, 5), (2, 2), (7, 7)):
        got = [i for s in range(pp) for i in stage_layers(L, pp, s)]
        assert got == list(range(L))


def _meta_model(cfg: dict):
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(cfg["model_type"], **{
        k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("plan", [Plan(dp=2, fsdp=2), Plan(dp=4, fsdp=4), Plan(dp=2, fsdp=2, ep=2),
                                  Plan(dp=4, fsdp=4, ep=2), Plan(dp=2), Plan(pp=2)])
def test_planned_rank_numel_matches_torch_sharding(tiny_cfg, tiny, plan):
    """FSDP2 shards every parameter with torch.chunk on dim 0; EP gives each rank a
    contiguous block of experts: sum the real pieces of the real module tree."""
    import torch

    model = _meta_model(tiny_cfg)
    for rank in range(plan.world):
        c = plan.coords(rank)
        layers = set(stage_layers(tiny.layers, plan.pp, c["pp"]))
        want = 0
        for name, p in model.named_parameters():
            layer = int(name.split(".")[2]) if ".layers." in name else None
            if layer is not None and layer not in layers:
                continue
            on_stage = c["pp"] == 0 if "embed" in name else c["pp"] == plan.pp - 1
            if layer is None and not on_stage:
                continue
            t = p
            if ".experts." in name and plan.ep > 1:
                t = torch.chunk(t, plan.ep)[c["ep"]]
                k, i = plan.efsdp, c["efsdp"]
            else:
                k, i = plan.fsdp, c["fsdp"]
            pieces = torch.chunk(t, k) if k > 1 else (t,)
            want += pieces[i].numel() if i < len(pieces) else 0
        got = sum(planned_rank_numel(tiny, plan, rank).values())
        assert got == want, (rank, got, want)
        assert planned_rank_bytes(tiny, plan, rank, "float32") == 4 * want


def test_search_path_agrees_with_exact_per_rank_count():
    spec = spec_from_path(MODELS / "deepseek-v3.json")
    for plan in (Plan(tp=8, pp=2, ep=8, dp=1), Plan(tp=1, pp=1, ep=8, dp=16, fsdp=16),
                 Plan(tp=4, pp=4, ep=4, dp=1)):
        mem = memory_for_plan(spec, plan, Workload(), 80e9, 3e9)
        assert mem.weights_numel == sum(planned_rank_numel(spec, plan, mem.rank).values())


def test_kv_cache_per_token_gqa_mla_and_sliding_window():
    mix = spec_from_path(MODELS / "mixtral-8x7b.json")  # 8 KV heads x 128, 32 layers
    assert kv_bytes_per_token(mix, Plan(), range(32), 1, "bf16") == 32 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(mix, Plan(tp=4, dp=2), range(32), 1, "fp8") == 32 * 2 * 2 * 128
    ds = spec_from_path(MODELS / "deepseek-v3.json")  # MLA: latent 512 + rope 64, not TP-split
    assert kv_bytes_per_token(ds, Plan(tp=8), range(61), 1, "bf16") == 61 * 576 * 2
    oss = spec_from_path(MODELS / "gpt-oss-120b.json")  # every other layer: a 128-token window
    full = kv_bytes_per_token(oss, Plan(), range(36), 8192, "bf16")
    assert full == 18 * (8192 + 128) * 2 * 8 * 64 * 2


def test_low_precision_halves_the_matmul_weights():
    spec = spec_from_path(MODELS / "qwen3-235b-a22b.json")
    hw = load_hardware("h100-80g-x8")
    bf16, fp8 = weights_alone(spec, hw, "bf16"), weights_alone(spec, hw, "fp8")
    assert 0.5 < fp8["bytes"] / bf16["bytes"] < 0.51  # embeddings / norms stay bf16
    assert fp8["devices"] < bf16["devices"]


def test_reference_model_needs_seventy_80gb_devices_for_weights():
    spec = spec_from_path(MODELS / "reference-2.8t.json")
    c = count_params(spec)
    assert spec.num_experts == 896 and spec.experts_per_tok == 16 and c.vision > 0
    w = weights_alone(spec, load_hardware("h100-80g-x8"))
    assert 5.5 < w["tb"] < 5.7 and w["devices"] >= 70
    res = search(spec, load_hardware("h100-80g-x8"), Workload(mode="inference"))
    assert res.best is None and res.smallest["devices"] >= 72
    with pytest.raises(UserError, match=r"weights alone are 5631\.2 GB .*smallest that fits is \d+ node"):
        plan_record(res)


def test_real_models_get_sensible_plans():
    mix = spec_from_path(MODELS / "mixtral-8x7b.json")
    res = search(mix, load_hardware("h100-80g-x8"), Workload(mode="lora", seq_len=4096))
    best = res.best
    assert best and best.plan.world == 8  # LoRA runs on TP shards too (tp_lora)
    p = best.plan  # 93 GB of weights need sharding, by TP, FSDP or EP
    assert best.memory.total <= 80e9 and p.tp * p.fsdp * p.ep > 1
    assert len(res.feasible) > 3 and res.rejected_summary()
    ds = spec_from_path(MODELS / "deepseek-v3.json")
    assert ds.precision["experts"] == "fp8"  # its release: FP8 blocks, 0.69 TB fit one node
    fp8 = search(ds, load_hardware("h200-141g-x8"), Workload(mode="inference", batch=8, context=8192))
    assert fp8.best is not None and fp8.best.plan.world == 8
    ds.precision = {}  # dequantised to bf16
    one = search(ds, load_hardware("h200-141g-x8"), Workload(mode="inference", batch=8, context=8192))
    assert one.best is None and one.smallest["nodes"] == 2  # 1.34 TB > 8 x 141 GB
    two = search(ds, load_hardware("h200-141g-x8", nodes=2), Workload(mode="inference", batch=8))
    assert two.best and two.best.plan.tp == 8 and two.best.cost["tpot_s"] > 0
    gen = search(ds, load_hardware("h200-141g-x8", nodes=2), Workload(mode="inference"), runtime="generic")
    assert gen.best.score >= two.best.score  # fewer constraints never rank worse


def test_cpu_local_lora_plan_is_small_and_runnable(tiny):
    hw = load_hardware("cpu-local")
    res = plan_with_degrees(tiny, hw, Workload(seq_len=64, lora_rank=8), {})
    rec = plan_record(res, "tiny")
    assert rec["num_workers"] == 2 and rec["data_parallel"] == 2
    assert (rec["tensor_parallel"], rec["pipeline_parallel"]) == (1, 1)
    for key in ("expert_parallel", "fsdp", "mode", "distributed_config", "memory", "alternatives"):
        assert key in rec
    ep = plan_record(plan_with_degrees(tiny, hw, Workload(seq_len=64), {"expert_parallel": 2}))
    assert (ep["expert_parallel"], ep["fsdp"], ep["data_parallel"]) == (2, 2, 2)
    assert ep["distributed_config"] == {"tp_size": 1, "pp_size": 1, "ep_size": 2,
                                        "fsdp_size": 2, "dp_replicate_size": 1}
    fs = plan_record(plan_with_degrees(tiny, hw, Workload(seq_len=64), {"fsdp": 2}))
    assert fs["data_parallel_impl"] == "fsdp2"


def test_cpu_local_inference_plan_is_replicas(tiny):
    rec = plan_record(search(tiny, load_hardware("cpu-local"), Workload(mode="inference", batch=4)))
    assert (rec["num_workers"], rec["data_parallel"], rec["fsdp"]) == (2, 2, 1)
    assert rec["distributed_config"] is None and rec["memory"]["parts_gb"]["kv_cache"] > 0


def test_runtime_limits_are_planned_around(tiny):
    hw = load_hardware("cpu-local")
    experts = Workload(seq_len=64, lora_targets=("attention", "experts"))
    with pytest.raises(UserError, match="PEFT expert LoRA does not combine"):
        plan_with_degrees(tiny, hw, experts, {"expert_parallel": 2, "tensor_parallel": 1})
    ep_tp = plan_with_degrees(tiny, hw, experts, {"expert_parallel": 2, "tensor_parallel": 2}).best
    assert (ep_tp.plan.ep, ep_tp.plan.tp) == (2, 2)  # split expert LoRA by expert (tp_lora)
    best = plan_with_degrees(tiny, hw, experts, {}).best
    assert best.plan.ep == 1 and any("expert LoRA" in n for n in search(tiny, hw, experts).notes)
    tp = plan_with_degrees(tiny, hw, Workload(seq_len=64), {"tensor_parallel": 2}).best
    assert tp.plan.tp == 2  # attention LoRA runs on tensor-parallel shards (tp_lora)
    tp_experts = plan_with_degrees(tiny, hw, experts, {"tensor_parallel": 2}).best
    assert tp_experts.plan.tp == 2  # expert LoRA too (tp_lora: split expert LoRA under TP)
    with pytest.raises(UserError, match="no plan has these degrees"):
        plan_with_degrees(tiny, hw, Workload(seq_len=64), {"data_parallel": 3})


def test_infeasible_explicit_plan_names_budget_and_excess():
    mix = spec_from_path(MODELS / "mixtral-8x7b.json")
    hw = load_hardware("h100-80g-x8")
    with pytest.raises(UserError, match=r"DP=8 FSDP=1.*over the 80 GB device memory budget by \d+(\.\d+)? GB"):
        plan_with_degrees(mix, hw, Workload(seq_len=4096), {"data_parallel": 8, "fsdp": 1})


def test_expected_rank_bytes_from_a_record(tiny_cfg, tiny, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg))
    rec = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 2,
           "data_parallel": 2, "fsdp": 2}
    got = [expected_rank_bytes(rec, str(tmp_path), r, "float32") for r in range(2)]
    assert got == [planned_rank_bytes(tiny, Plan(ep=2, dp=2, fsdp=2), r, "float32") for r in range(2)]
    assert sum(got) == 4 * count_params(tiny).total  # EP + FSDP: every parameter held once
    with pytest.raises(UserError, match="degree"):
        expected_rank_bytes({"tensor_parallel": 1}, tiny_cfg, 0)
