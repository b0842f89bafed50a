"""What one worker of a stage that never holds the model holds (moeflow/parallel/footprint.py):
calibrate's layer x expert-group split and its `auto` resolution, on the reference preset built
on the meta device. Pure: no weights, no Ray."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from moeflow.core.hardware import load_hardware
from moeflow.model.params import EXPERT_KINDS, count_params, spec_from_path
from moeflow.parallel.footprint import F32, calibrate_layout, group_bytes, layer_splits, unit_params

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference():
    spec = spec_from_path(str(REPO / "configs" / "models" / "reference-2.8t.json"))
    return spec, count_params(spec), load_hardware("supernode-384")


def test_a_layer_splits_into_its_dense_part_and_its_experts(reference):
    spec, counts, _ = reference
    splits = layer_splits(spec)
    assert len(splits) == spec.layers
    experts = sum(t.numel for t in spec.tensors if t.kind in EXPERT_KINDS and t.layer is not None)
    inside = sum(t.numel for t in spec.tensors if t.layer is not None)
    assert sum(s.experts for s in splits) == experts
    assert sum(s.dense + s.experts for s in splits) == inside
    moe = splits[spec.moe_layers[0]]
    # two groups: the designated one holds the dense part and ceil(E / 2) experts, in float32,
    # and reads its largest tensor (half the stacked experts' largest) in the stored dtype
    assert group_bytes(moe, 2, 2) == pytest.approx((moe.dense + moe.experts / 2) * F32 + moe.largest_expert / 2 * 2)
    assert group_bytes(moe, 1, 2) == pytest.approx((moe.dense + moe.experts) * F32 + moe.largest_expert * 2)
    odd = group_bytes(moe, 3, 2)  # 896 experts in 3 groups: 299 in the fullest
    assert odd == pytest.approx((moe.dense + moe.experts * math.ceil(896 / 3) / 896) * F32
                                + moe.largest_expert * math.ceil(896 / 3) / 896 * 2)


def test_auto_picks_the_fewest_expert_groups_whose_worker_fits_a_device(reference):
    spec, counts, hw = reference
    lay = calibrate_layout(spec, counts, hw, "auto", "auto", stored=2, tokens=4096)
    budget = hw.memory_bytes - hw.runtime_overhead_gb * 1e9
    assert lay.layer_workers == hw.devices_per_node == 8  # the model exceeds a device in float32
    assert lay.expert_groups == 2 and lay.workers == 16
    assert lay.memory_bytes <= budget
    one = calibrate_layout(spec, counts, hw, "auto", 1, stored=2, tokens=4096)
    assert one.expert_groups == 1 and one.memory_bytes > hw.memory_bytes  # a whole layer: too much
    assert "896 experts split into 2 groups" in lay.why[0]
    pinned = calibrate_layout(spec, counts, hw, 4, 8, stored=2, tokens=4096)
    assert (pinned.layer_workers, pinned.expert_groups, pinned.workers) == (4, 8, 32)
    assert pinned.memory_bytes < lay.memory_bytes
    # the stage task beside its workers holds what is outside the layers and the recorded inputs
    assert lay.front_bytes == pytest.approx(unit_params(spec)[1] * F32 + 4096 * spec.hidden * F32 * 4)


def test_a_model_that_fits_a_device_runs_calibrate_in_one_process(reference):
    spec, counts, hw = reference
    huge = hw.model_copy(update={"memory_per_device_gb": 4 * counts.total * 1.01 / 1e9})
    lay = calibrate_layout(spec, counts, huge, "auto", "auto", stored=2, tokens=4096)
    assert (lay.layer_workers, lay.expert_groups, lay.workers, lay.split) == (1, 1, 0, False)
    layer, outer = unit_params(spec)
    assert lay.memory_bytes == pytest.approx(lay.worker_bytes)
    assert 4 * layer < lay.memory_bytes < 4 * (layer + outer) + 4096 * spec.hidden * 16 + 2 * layer
