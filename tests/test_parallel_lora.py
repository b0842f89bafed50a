"""LoRA under tensor and context parallelism matches one process.

On CPU over gloo, fp32, tiny Qwen3-MoE (GQA) and DeepSeek-V3 (MLA, shared
experts) models: TP=2, CP=2, TP2 x EP2 and TP2 x FSDP2 runs of the same two
optimizer steps (the same micro-batches: packed rows, prompt tokens unlabelled)
give the single-process loss of every step and every LoRA gradient (gathered
whole) within 1e-5 relative. Plain SGD between the steps, so the second step's
gradients are taken at moved adapters (Adam would turn float rounding of a
near-zero gradient into a whole step, moeflow.training.parallel_check).

The default suite runs TP=2 on Qwen3-MoE and the pure pieces; the rest is slow.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.training import parallel_check as P

TOL = 1e-5
FAMILIES = {"qwen3_moe": ["attention"],
            # DeepSeek-V3: MLA (its TP plan leaves attention whole and shards the experts; PEFT
            # takes its shared experts for routed ones, so they are not a module target)
            "deepseek_v3": ["attention"]}
_REF: dict[str, dict] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("par")
    return {f: str(build_debug_model(f, root / f, dtype="float32")) for f in FAMILIES}


def _check(models, family: str, targets: list[str] | None = None, **layout) -> dict:
    targets = targets or FAMILIES[family]
    kw = dict(targets=targets, steps=2)
    key = f"{family}:{','.join(targets)}"
    if key not in _REF:
        _REF[key] = P.run(models[family], **kw)
    got = P.run(models[family], **layout, **kw)
    diff = P.compare(_REF[key], got)
    assert diff["loss_rel"] < TOL and diff["grad_rel"] < TOL, diff
    assert any(float(g.abs().sum()) > 0 for g in got["grads"][1].values())  # step 2 moved
    return diff


@pytest.mark.integration  # gloo ranks in processes of their own (parallel_check spawns them)
def test_tp2_matches_one_process(models):
    # attention (colwise q/k/v, rowwise o) and routed experts (packed_colwise gate|up, rowwise
    # down: split expert LoRA under TP) in one run; the single process runs PEFT's own path.
    # The TP run is checkpointed after step 1 and resumed into a fresh adapter (each rank
    # restores its piece of the whole saved one): step 2 must still match.
    _check(models, "qwen3_moe", ["attention", "experts"], tp=2, resume_at=1)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [
    ("deepseek_v3", {"tp": 2}),
    ("qwen3_moe", {"tp": 2, "ep": 2}),  # experts sharded by expert: LoRA by expert too
    ("deepseek_v3", {"tp": 2, "ep": 2}),
    ("qwen3_moe", {"fsdp": 2, "dp": 2}),
    ("qwen3_moe", {"tp": 2, "fsdp": 2, "dp": 2}),
], ids=["dsv3-tp2", "qwen-tp2-ep2", "dsv3-tp2-ep2", "qwen-fsdp2", "qwen-tp2-fsdp2"])
def test_expert_lora_matches_one_process(models, family, layout):
    _check(models, family, ["attention", "experts"], **layout)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [
    pytest.param("qwen3_moe", {"cp": 2}, marks=pytest.mark.ci),
    pytest.param("qwen3_moe", {"tp": 2, "ep": 2}, marks=pytest.mark.ci),
    ("qwen3_moe", {"tp": 2, "fsdp": 2, "dp": 2}),
    ("deepseek_v3", {"tp": 2}),
    ("deepseek_v3", {"cp": 2}),
    ("deepseek_v3", {"tp": 2, "ep": 2}),
    ("deepseek_v3", {"tp": 2, "fsdp": 2, "dp": 2}),
    ("qwen3_moe", {"tp": 2, "cp": 2}),
    ("qwen3_moe", {"cp": 2, "fsdp": 2}),  # FSDP shards over the CP ranks (data ranks to transformers)
    # the reference plan's shape (TP x CP, FSDP over every data rank, the CP ranks included)
    ("qwen3_moe", {"tp": 2, "cp": 2, "fsdp": 2}),
    ("qwen3_moe", {"tp": 2, "cp": 2, "fsdp": 2, "dp": 2}),  # and with HSDP replicas, 8 ranks
], ids=["qwen-cp2", "qwen-tp2-ep2", "qwen-tp2-fsdp2", "dsv3-tp2", "dsv3-cp2", "dsv3-tp2-ep2",
        "dsv3-tp2-fsdp2", "qwen-tp2-cp2", "qwen-cp2-fsdp2", "qwen-tp2-cp2-fsdp2", "qwen-tp2-cp2-fsdp2-dp2"])
def test_parallel_layouts_match_one_process(models, family, layout):
    _check(models, family, **layout)


# ------------------------------------------------------------ pure pieces


def test_shard_bounds_cut_as_dtensor_shard():
    from moeflow.training.tp_lora import shard_bounds

    assert [shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [shard_bounds(64, 2, r) for r in range(2)] == [(0, 32), (32, 64)]


def test_initial_lora_is_layout_independent_and_peft_shaped():
    from moeflow.training.tp_lora import initial_lora

    a, b = initial_lora("model.layers.0.self_attn.q_proj", 4, 64, 32, seed=7)
    a2, _ = initial_lora("model.layers.0.self_attn.q_proj", 4, 64, 32, seed=7)
    a3, _ = initial_lora("model.layers.1.self_attn.q_proj", 4, 64, 32, seed=7)
    assert a.shape == (4, 64) and b.shape == (32, 4) and not b.any()
    assert torch.equal(a, a2) and not torch.equal(a, a3)
    assert float(a.abs().max()) <= 1 / 64 ** 0.5  # Kaiming-uniform(a=sqrt(5)) bound


def test_cp_split_shifts_labels_over_the_whole_row():
    from moeflow.training.context_parallel import split

    ids = torch.arange(8)[None]  # [1, 8]
    batch = {"input_ids": ids, "labels": ids + 100, "position_ids": ids,
             "real": torch.ones(1, 8, dtype=torch.bool)}
    first, second = split(batch, 2, 0), split(batch, 2, 1)
    assert first["labels"].tolist() == [[101, 102, 103, 104]]  # the last predicts token 4
    assert second["labels"].tolist() == [[105, 106, 107, -100]]
    assert second["input_ids"].tolist() == [[4, 5, 6, 7]] and first["shifted"]
    assert torch.equal(second["positions"], ids)


def test_whole_sequence_mask_keeps_packed_examples_apart():
    from moeflow.training.context_parallel import whole_sequence_mask

    assert whole_sequence_mask(torch.arange(6)[None], None) is None  # plain causal
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    m = whole_sequence_mask(pos, None)[0, 0]
    assert m[4, 3] and m[4, 4] and not m[4, 2] and not m[4, 5]
    w = whole_sequence_mask(torch.arange(6)[None], 2)[0, 0]
    assert w[5, 4] and not w[5, 3]


def test_layout_coordinates_tp_innermost():
    from moeflow.training.parallel import coords

    # 8 ranks, TP 2 x CP 2 x DP 2: TP pairs are consecutive, CP pairs stride 2
    assert [coords(r, 2, 2, 8) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]


@pytest.mark.parametrize("plan, match", [
    ({"num_workers": 2, "tensor_parallel": 2, "data_parallel": 1}, None),
    ({"num_workers": 4, "tensor_parallel": 2, "data_parallel": 2, "fsdp": 2}, None),
    ({"num_workers": 2, "data_parallel": 2, "context_parallel": 2}, None),
    ({"num_workers": 4, "tensor_parallel": 2, "data_parallel": 2, "context_parallel": 4},
     "context_parallel=4 must divide data_parallel=2"),
    ({"num_workers": 4, "tensor_parallel": 2, "data_parallel": 1}, "they must be equal"),
    ({"num_workers": 2, "tensor_parallel": 2, "data_parallel": 1, "expert_parallel": 4},
     "multiple of tensor_parallel"),
])
def test_check_plan_tp_cp(plan, match):
    from moeflow.core.errors import UserError
    from moeflow.training.driver import check_plan
    from moeflow.training.lora import Targets

    targets = Targets(parameters=[])
    if match is None:
        out = check_plan(plan, targets)
        tp = plan.get("tensor_parallel", 1)
        assert out.tensor_parallel == tp and out.num_workers == plan["num_workers"]
        assert (out.distributed is None) == (tp == 1 and plan.get("fsdp", 1) == 1)
    else:
        with pytest.raises(UserError, match=match):
            check_plan(plan, targets)


def test_expert_lora_under_tp_and_ep_equal_to_tp_is_planned_else_refused_in_one_line():
    from moeflow.core.errors import UserError
    from moeflow.training.driver import check_plan
    from moeflow.training.lora import Targets

    experts = Targets(parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    out = check_plan({"num_workers": 2, "tensor_parallel": 2, "data_parallel": 1}, experts)
    assert out.tensor_parallel == 2 and out.distributed["tp_size"] == 2
    tp_ep = check_plan({"num_workers": 2, "tensor_parallel": 2, "data_parallel": 1,
                        "expert_parallel": 2, "fsdp": 1}, experts)
    assert tp_ep.distributed["ep_size"] == 2  # EP group = TP group: experts LoRA by expert
    for ep, fsdp in ((4, 2), (2, 2)):  # EP wider than TP; EP = TP with FSDP cutting experts
        with pytest.raises(UserError, match="expert LoRA on an EP-sharded") as exc:
            check_plan({"num_workers": 4, "tensor_parallel": 2, "data_parallel": 2,
                        "expert_parallel": ep, "fsdp": fsdp}, experts)
        assert "\n" not in str(exc.value)
    fsdp = check_plan({"num_workers": 4, "tensor_parallel": 2, "data_parallel": 2, "fsdp": 2},
                      experts)
    assert fsdp.distributed["fsdp_size"] == 2  # expert LoRA on FSDP-sharded experts


def test_piece_index_cuts_packed_tensors_as_transformers_does():
    from moeflow.training.tp_lora import piece_index

    # gate|up packed [2I] with I = 6 over 2 ranks: each rank its gate rows then its up rows
    assert piece_index(12, 2, 2, 0).tolist() == [0, 1, 2, 6, 7, 8]
    assert piece_index(12, 2, 2, 1).tolist() == [3, 4, 5, 9, 10, 11]
    assert piece_index(10, 1, 4, 3).tolist() == [9]  # unpacked: DTensor's Shard
