"""The rehearsal of the stages at scale (benchmarks/rehearse_streamed.py): a checkpoint 4x
larger than a device of cluster/hardware/cpu-budget.yaml, on Ray workers: operators,
calibrate (layer ranges; expert groups on a model whose layer exceeds a device), convert,
regress (layer-streamed and layer ranges), finetune, and where the vLLM environment exists
serving and deploy on vLLM. Slow (about 12 minutes)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_stages_hold_a_device_share_and_equal_the_one_device_run(tmp_path):
    # no ray_local: the rehearsal starts its own Rays (2 CPUs for the stages, then a node of 8
    # devices for serving, which a Ray already connected here could not give it)
    from benchmarks.rehearse_streamed import checks, rehearse

    rec = rehearse(tmp_path, layers=40)
    assert not checks(rec), checks(rec)
    assert rec["checkpoint_bytes"] >= 4 * rec["budget_bytes"]
    # the one-process operators run held the whole model: the budget is a real constraint
    assert max(rec["one_device_peaks"]["operators (profile shards)"]) > 4 * rec["budget_bytes"]
    # one wide layer whole is over the budget: calibrate had to split inside the layers (its
    # group processes within the budget, its report and tensors the one process's: checks)
    assert max(rec["one_device_peaks"]["calibrate compare ranges + group 1"]) > rec["budget_bytes"]
    assert rec["expert_groups"] >= 2
    # regress: streamed where the model exceeds the device, the loaded model's metrics and verdict
    assert rec["regress_streamed"] and rec["regress_equal"]
    assert max(rec["one_device_peaks"]["regress (streamed)"]) > 4 * rec["budget_bytes"]
