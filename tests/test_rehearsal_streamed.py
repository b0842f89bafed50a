"""The rehearsal of the stages at scale (benchmarks/rehearse_streamed.py): a checkpoint 4x
larger than a device of cluster/hardware/cpu-budget.yaml, on Ray workers. Slow (minutes)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_stages_hold_a_device_share_and_equal_the_one_device_run(tmp_path, ray_local):
    from benchmarks.rehearse_streamed import checks, rehearse

    rec = rehearse(tmp_path, layers=40)
    assert not checks(rec), checks(rec)
    assert rec["checkpoint_bytes"] >= 4 * rec["budget_bytes"]
    # the one-process operators run held the whole model: the budget is a real constraint
    assert max(rec["one_device_peaks"]["operators (profile shards)"]) > 4 * rec["budget_bytes"]
