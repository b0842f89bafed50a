"""The rehearsal's finetune (benchmarks/rehearse_stages.py, issue 45): a checkpoint 4x a device
of cluster/hardware/cpu-budget.yaml, LoRA-trained on the plan stage's plan (8 gloo ranks: EP8
FSDP8 CP2; Ray Train over a 4-node Ray cluster on this host), each rank's model-attributable
peak within the device's budget and its losses those of one process (within the stated
tolerances). Slow (minutes)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_finetune_ranks_train_as_one_process_on_the_plan(tmp_path):
    from benchmarks.rehearse_stages import finetune_checks, rehearse_finetune
    from benchmarks.rehearse_streamed import BUDGET_SPEC, FT_LAYERS, FT_NODES, build, finetune_lines

    model = build(tmp_path, FT_LAYERS)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    rec = rehearse_finetune(tmp_path, model, BUDGET_SPEC, nodes=FT_NODES, steps=3)
    print("\n".join(finetune_lines(rec)))  # the numbers of docs/streamed.md (pytest -s)
    assert not finetune_checks(rec), finetune_checks(rec)
    assert size >= 4 * rec["budget_bytes"]  # 4x a device: the plan shards it
    assert rec["plan"]["num_workers"] == 2 * FT_NODES and rec["plan"]["fsdp"] == 2 * FT_NODES
    assert rec["plan_memory_gb"] * 1e9 <= rec["budget_bytes"]
    assert len(rec["ranks"]["losses"]) == 3
    # each rank's model-attributable peak is measured and within one device's budget
    # (finetune_checks holds it too; here on its own, so a failure names the peaks)
    peaks = rec["ranks"]["peaks"]
    assert all(0 < p <= rec["budget_bytes"] for p in peaks), (peaks, rec["budget_bytes"])
    assert all(p < rec["one_device"]["peaks"][0] for p in rec["ranks"]["peaks"])
