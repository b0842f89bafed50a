"""The rehearsal's finetune (benchmarks/rehearse_stages.py, issue 45): a checkpoint 4x a
device of cluster/hardware/cpu-budget.yaml, LoRA-trained on the plan's 8 gloo ranks
(Ray Train over a 4-node Ray cluster on this host), each rank's model-attributable peak
within the device's budget and its losses those of one process. Slow (minutes)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_finetune_ranks_hold_a_device_share_and_train_as_one_process(tmp_path):
    from benchmarks.rehearse_stages import finetune_checks, rehearse_finetune
    from benchmarks.rehearse_streamed import BUDGET_SPEC, FT_LAYERS, FT_NODES, build

    model = build(tmp_path, FT_LAYERS)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    rec = rehearse_finetune(tmp_path, model, BUDGET_SPEC, nodes=FT_NODES, steps=3)
    assert not finetune_checks(rec), finetune_checks(rec)
    assert size > 4 * rec["budget_bytes"]  # no rank could hold the model
    assert rec["plan"]["num_workers"] == 8 and rec["plan"]["fsdp"] == 8
    # the one process held the whole model: the budget is a real constraint
    assert rec["one_device"]["peaks"][0] > 2 * rec["budget_bytes"]
    assert len(rec["ranks"]["losses"]) == 3
