"""deploy applies the plan's inference degrees (replicas) unless the config sets them."""

import pytest

from moeflow.core.config import validate
from moeflow.serving.launch import apply_plan

pytestmark = pytest.mark.integration


def _cfg(**deploy):
    return validate({"model": {"path": "/m"}, "deploy": deploy})


def test_replicas_come_from_the_plan_and_fit_free_cpus(ray_local):
    out = apply_plan(_cfg(), {"num_replicas": 2})
    assert out.deploy.num_replicas == 2
    assert out.deploy.num_replicas * out.deploy.num_cpus <= 2  # ray_local has 2 CPUs
    assert apply_plan(_cfg(), None).deploy.num_replicas == 1
    explicit = apply_plan(_cfg(num_replicas=3, num_cpus=0.5), {"num_replicas": 2})
    assert (explicit.deploy.num_replicas, explicit.deploy.num_cpus) == (3, 0.5)


def test_plan_stage_emits_a_serving_plan(tmp_path):
    from moeflow_testing.tiny import build_debug_model
    from tasks.base import StageContext
    from tasks.plan import run

    model = build_debug_model("qwen3_moe", tmp_path / "m")
    cfg = validate({"model": {"path": str(model)}, "hardware": "cpu-local"})
    out = tmp_path / "out"
    out.mkdir()
    record = run(StageContext(stage="plan", config=cfg, inputs={}, out_dir=out))
    serving = record["plan"]["serving"]
    assert serving["num_replicas"] >= 1 and serving["tensor_parallel"] == 1
