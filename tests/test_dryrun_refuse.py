"""The dry run refuses a stage that cannot run as planned: memory per device over the spec's
device is a failing check naming the stage, what it needs and the setting that fixes it, for
every stage (calibrate too). Pure: the demo model on the meta device, hardware specs written
here (no Ray, no weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moeflow.core.config import load_config
from moeflow.parallel.memory import human
from workflows.dryrun import dry_run

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"
DEMO_BASE = REPO / "assets" / "demo-base"
SETTINGS = ("stages.enabled", "calibrate.samples", "finetune.micro_batch_size", "deploy.backend",
            "hardware.spec")


def spec_file(tmp_path: Path, name: str, memory_gb: float, overhead_gb: float = 0.0) -> Path:
    """A one-node, two-device CPU spec whose device holds `memory_gb` (not the anchor's name: no
    host probe)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "accelerator": "x86_64 CPU core (gloo)", "devices_per_node": 2,
        "memory_per_device_gb": memory_gb, "hbm_bandwidth_gbs": 10, "bf16_tflops": 0.19,
        "intra_node_bandwidth_gbs": 2, "inter_node_bandwidth_gbs": 1.25, "hbd_size": 2,
        "runtime_overhead_gb": overhead_gb}))
    return path


def demo(tmp_path: Path, spec: Path, *extra: str):
    return load_config(DEMO, [f"model.path={DEMO_BASE}", f"hardware={spec}",
                              f"workdir={tmp_path / 'runs'}", *extra])


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """Each stage's memory per device on a device that holds them all."""
    tmp = tmp_path_factory.mktemp("roomy")
    est, _ = dry_run(demo(tmp, spec_file(tmp, "roomy", 64.0)))
    assert not est.refused, est.refused
    return {s.name: s.memory_per_device for s in est.stages}


# each stage pinned to the layout that holds the most (auto would stream or split it instead)
WHOLE = {"operators": ["operators.streamed=never"], "regress": ["regress.streamed=never"],
         "calibrate": ["calibrate.layer_workers=1", "calibrate.expert_groups=1"]}


@pytest.mark.parametrize("stage", ["operators", "calibrate", "regress"])
def test_a_device_smaller_than_a_stage_refuses_that_stage_and_every_larger_one(tmp_path, roomy, stage):
    device = 0.9 * roomy[stage]
    est, _ = dry_run(demo(tmp_path, spec_file(tmp_path, "small", device / 1e9), *WHOLE[stage]))
    refused = {c.name: c.message for c in est.refused}
    over = {s.name for s in est.stages if s.memory_per_device > device}
    assert stage in over
    # every stage over the device is refused (no warning), and nothing else by memory
    assert {f"memory.{n}" for n in over} <= set(refused)
    assert not [c for c in est.checks if c.name.startswith("memory.") and c.status == "warn"]
    for name in over:
        msg = refused[f"memory.{name}"]
        figure = next(s.memory_per_device for s in est.stages if s.name == name)
        assert msg.startswith(f"{name} needs {human(figure)} per device, over {human(device)}"), msg
        assert any(key in msg for key in SETTINGS), msg  # the setting that fixes it


def test_a_roomy_device_refuses_nothing_and_prices_every_stage(tmp_path, roomy):
    est, _ = dry_run(demo(tmp_path, spec_file(tmp_path, "roomy", 64.0)))
    assert not est.refused
    assert {c.name for c in est.checks if c.name.startswith("memory")} == {"memory"}
    assert set(roomy) == {"convert", "plan", "operators", "calibrate", "finetune", "regress",
                          "serving", "deploy"}


def test_finetune_over_its_device_names_its_micro_batch(tmp_path, roomy):
    """finetune's own micro-batch beyond what the plan assumed: refused with the knob."""
    est, _ = dry_run(demo(tmp_path, spec_file(tmp_path, "roomy", 64.0),
                          "finetune.micro_batch_size=1000000", "finetune.gradient_checkpointing=false"))
    refused = {c.name: c.message for c in est.refused}
    assert "memory.finetune" in refused and "finetune.micro_batch_size 1000000" in refused["memory.finetune"]
