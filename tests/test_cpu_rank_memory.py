"""Which CPU ranks take the tight memory settings (moeflow.training.worker.cpu_rank_memory:
oneDNN off, a fixed 64 KB mmap threshold): only those whose plan's device is under
TIGHT_DEVICE_FACTOR x the plan's peak. The settings cost CPU time (a float32 step of the demo
model 1.4-1.9x), so a rank on a roomy device keeps torch's defaults. The rehearsal's finetune
(tests/test_rehearsal_finetune.py, slow) is where the tight side is seen to hold its budget."""

from __future__ import annotations

import pytest

from moeflow.core.config import LoraSection, OptimizerSection
from moeflow.core.hardware import TIGHT_DEVICE_FACTOR, load_hardware
from moeflow.model.params import model_spec
from moeflow.parallel.memory import Workload
from moeflow.parallel.planner import plan_record, plan_with_degrees
from moeflow.training.worker import WorkerConfig, tight_cpu_rank


@pytest.fixture(scope="module")
def tiny_plan() -> dict:
    from moeflow_testing.tiny import debug_config

    spec = model_spec(debug_config("qwen3_moe").to_dict())
    return plan_record(plan_with_degrees(spec, load_hardware("cpu-local"), Workload(seq_len=64, lora_rank=8), {}))


def worker(plan: dict, use_gpu: bool = False) -> WorkerConfig:
    return WorkerConfig(base_dir="-", dtype="float32", seed=0, lora=LoraSection(), optimizer=OptimizerSection(),
                        use_gpu=use_gpu, **WorkerConfig.plan_memory(plan))


def test_the_plans_peak_and_device_come_from_plan_json(tiny_plan):
    got = WorkerConfig.plan_memory(tiny_plan)
    assert got["device_bytes"] == pytest.approx(12.8e9)  # cpu-local's memory_per_device_gb
    assert got["planned_peak_bytes"] == pytest.approx(tiny_plan["memory"]["total_gb"] * 1e9)
    assert WorkerConfig.plan_memory({"num_workers": 1}) == {"planned_peak_bytes": None, "device_bytes": None}


def test_only_a_device_near_the_plans_peak_is_tight(tiny_plan):
    assert not tight_cpu_rank(worker(tiny_plan))  # the demo's case: a 12.8 GB device, a small plan
    peak = tiny_plan["memory"]["total_gb"]
    for factor, tight in ((1.25, True), (TIGHT_DEVICE_FACTOR * 0.99, True), (TIGHT_DEVICE_FACTOR * 1.01, False)):
        plan = {**tiny_plan, "hardware": {**tiny_plan["hardware"], "memory_per_device_gb": peak * factor}}
        assert tight_cpu_rank(worker(plan)) is tight, factor
        assert not tight_cpu_rank(worker(plan, use_gpu=True))  # a GPU rank's host memory is not its device
    # no hardware in the record (a plan written by hand, the one-device run): torch's defaults
    assert not tight_cpu_rank(worker({k: v for k, v in tiny_plan.items() if k != "hardware"}))


def _mapped_files() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of safetensors files (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((lo, hi))
    return out


def test_a_tight_rank_owns_its_layers_weights_outside_the_checkpoints_mapping(tmp_path):
    """transformers leaves a CPU model's weights as views of the safetensors files it maps; a tight
    rank copies its decoder layers' out (moeflow.training.worker.own_weights), so a forward maps
    no file pages for them (the page cache's large folios mapped other ranks' shards too: the
    rehearsal's 40-layer ranks were 14-39 MB over their plan, and within it with the copy)."""
    import torch

    from moeflow.training import steps as T
    from moeflow.training.worker import own_weights
    from moeflow_testing.tiny import build_debug_model

    path = build_debug_model("qwen3_moe", tmp_path / "m", dtype="float32")
    model, _ = T.load_base(str(path), "float32")

    def in_files(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in _mapped_files())
    layers = [p for layer in model.model.layers for p in layer.parameters()]
    assert any(in_files(p) for p in layers)  # what transformers leaves (else this test shows nothing)
    ids = torch.arange(12)[None] % 50 + 3
    with torch.no_grad():
        before = model(input_ids=ids).logits
    copied = own_weights(model)
    assert copied == sum(p.numel() * p.element_size() for p in layers)
    assert not any(in_files(p) for p in model.model.layers.parameters())
    assert all(not p.requires_grad for p in model.parameters())  # still frozen
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
