"""The GPU check (benchmarks/gpu_check.sh / gpu_check.py) without a GPU: every command line
it runs names options and config keys that exist, and the hardware spec it writes plans
one GPU worker. These parts never ran before a GPU machine did; a typo there costs a
GPU session."""

from __future__ import annotations

import importlib.util
import re
import shlex
import types
from pathlib import Path

import pytest
import torch

from moeflow.core.config import apply_overrides, read_yaml, validate

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _commands() -> list[list[str]]:
    """gpu_check.sh's command lines (continuations joined), as argv lists."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.split(" 2>&1")[0].split(" | ")[0].strip()
        if line.startswith(("timeout ", "$PY ")):
            out.append(shlex.split(line))
    return out


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_demo_command_line_validates(tmp_path):
    """The demo's --set overrides apply to configs/demo.yaml as `moeflow demo` applies them
    (`hardware.spec=` cannot: demo.yaml's `hardware: cpu-local` is a string)."""
    demo = [c for c in _commands() if "demo" in c]
    assert len(demo) == 1, _commands()
    argv = demo[0][demo[0].index("demo"):]
    from typer.testing import CliRunner

    from workflows.cli import app
    from workflows.commands import register_all

    register_all(app)
    help_text = CliRunner().invoke(app, ["demo", "--help"], terminal_width=200).output
    options = [a for a in argv if a.startswith("--")]
    for opt in options:
        assert opt in help_text, f"moeflow demo has no option {opt}"
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    spec = tmp_path / "gpu-local-1.yaml"
    sets = [s.replace('$OUT/gpu-local-1.yaml', str(spec)).replace('"', "") for s in sets]
    raw = apply_overrides(read_yaml(REPO / "configs" / "demo.yaml"), sets)
    cfg = validate(raw, source="gpu_check.sh")
    assert cfg.hardware.spec == str(spec)
    assert cfg.finetune.use_gpu is True
    assert cfg.regress.shards > 1  # shards are Ray tasks asking for a GPU; 1 runs in the stage task


def test_hardware_spec_plans_one_gpu_worker(tmp_path, monkeypatch):
    """`gpu_check.py hardware` writes a spec load_hardware reads; the demo base plans 1 worker."""
    mod = _gpu_check_module()
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=150_000_000_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    out = tmp_path / "gpu-local-1.yaml"
    mod.hardware(out)
    from moeflow.core.hardware import load_hardware

    hw = load_hardware(str(out))
    assert hw.world_size == 1 and hw.memory_per_device_gb == 150.0
    import json

    from typer.testing import CliRunner

    from workflows.cli import app
    from workflows.commands import register_all

    register_all(app)
    res = CliRunner().invoke(app, ["plan", str(REPO / "assets" / "demo-base"), "--hardware", str(out),
                                   "--mode", "lora", "--seq-len", "64", "--micro-batch", "4", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["num_workers"] == 1 and plan["data_parallel"] == 1  # finetune: one GPU worker


def test_serve_check_paths_exist():
    """The other command lines: scripts exist and take the flags given."""
    import subprocess
    import sys

    for argv in _commands():
        if argv[0] != "$PY" or argv[1] == "-m" or argv[1] == "-c":
            continue
        script = REPO / argv[1]
        assert script.is_file(), argv
        flags = {a for a in argv[2:] if a.startswith("--")}
        help_text = subprocess.run([sys.executable, str(script), "--help"] if "gpu_check" not in argv[1]
                                   else [sys.executable, str(script), "-h"],
                                   capture_output=True, text=True, cwd=REPO, timeout=60).stdout
        for flag in flags:
            assert re.search(rf"{re.escape(flag)}\b", help_text), f"{argv[1]} has no flag {flag}"


# ---------------------------------------------------------------- adapters on a GPU host


@pytest.fixture(scope="module")
def tiny_with_adapter(tmp_path_factory):
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("gpu-host")
    base = build_debug_model("qwen3_moe", root / "tiny-moe", dtype="float32")
    return base, make_lora_adapter(base, root / "a1", seed=1), make_lora_adapter(base, root / "a2", seed=2)


@pytest.fixture
def gpu_host_cpu_task(monkeypatch):
    """A Ray task Ray gave no GPU, on a GPU host: torch sees the host's GPUs (Ray 2.60 no
    longer hides them from num_gpus=0 tasks), the task must compute on CPU. Any tensor
    sent to "cuda" fails here (CPU torch), as it would take another task's GPU there."""
    import ray

    from moeflow.core import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(devices, "_in_ray_worker", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])


def test_regress_adapters_load_onto_the_model_device(tiny_with_adapter, gpu_host_cpu_task):
    """HFRunner on CPU (a regress stage task without a GPU): PEFT's default adapter device is
    "cuda" whenever torch sees one; the adapter must load where the model is."""
    from moeflow.evaluation.runners import HFRunner

    base, a1, a2 = tiny_with_adapter
    runner = HFRunner(base, batch_size=4)
    assert runner.model.device == torch.device("cpu")
    runner.attach_adapter(a1)
    runner.attach_adapter(a2)  # the second goes through load_adapter
    assert {p.device.type for p in runner.model.parameters()} == {"cpu"}
    assert len(runner.generate(["reverse: abc\nanswer:"], 2, [])) == 1


def test_finetune_merge_stays_on_cpu(tiny_with_adapter, gpu_host_cpu_task, tmp_path):
    """finetune.merge in the finetune stage task (no GPU): base and adapter merge on CPU."""
    from moeflow.training.merge import write_merged

    base, a1, _ = tiny_with_adapter
    out = write_merged(str(base), a1, tmp_path / "merged", "float32")
    assert (out / "config.json").is_file()


# ---------------------------------------------------------------- finetune on a GPU


def test_finetune_reports_peak_device_memory_on_a_gpu(monkeypatch):
    """On a GPU the plan's peak is device memory: the worker measures torch's peak there
    (CPU workers: none, their RSS is the measure)."""
    from moeflow.training import trainer

    model = torch.nn.Linear(2, 2)
    assert trainer._peak_device_bytes(model) is None
    seen = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: seen.append(d) or 123)
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    assert trainer._peak_device_bytes(meta) is None  # not a GPU either
    fake = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device("cuda", 3))]))
    assert trainer._peak_device_bytes(fake) == 123 and seen == [torch.device("cuda", 3)]


# ---------------------------------------------------------------- serving on a GPU host


def test_serving_adapters_load_onto_the_replica_device(tiny_with_adapter, gpu_host_cpu_task):
    """A CPU replica on a GPU host (the serving search's candidates when GPUs run out): the
    engine loads adapters where its base is, in LoRA mode and in merged mode."""
    from transformers import AutoTokenizer

    from moeflow.model.models import load_model
    from moeflow.serving.adapters import AdapterRegistry, make_spec
    from moeflow.serving.app import ServeSettings, Service
    from moeflow.serving.engine import Engine, SamplingParams

    base, a1, a2 = tiny_with_adapter
    registry = AdapterRegistry()
    for name, path in (("a1", a1), ("a2", a2)):
        registry.add(make_spec(name, str(path), str(path)))
    engine = Engine(load_model(base, torch.float32), AutoTokenizer.from_pretrained(base), registry=registry)
    out = []
    for name in ("a1", "a2"):  # the second goes through load_adapter
        engine.submit(name, [5, 6, 7], SamplingParams(max_tokens=2), out.append, adapter=name)
    engine.run_until_idle()
    assert [d.error for d in out if d.finish_reason] == [None, None]
    runner = engine.core.runner
    resident = list(runner.peft.parameters()) if runner.peft is not None else [
        t for _, weights in runner.direct.values() for w in weights.values() for t in w[:2]]
    assert resident and {t.device.type for t in resident} == {"cpu"}
    runner.lora_mode()  # the slot stacks of the batched forward, where the base is
    assert {a.device.type for a, _ in runner._batched._stacks.values()} == {"cpu"}
    merged = Service(ServeSettings(base_dir=str(base), adapters={"a1": str(a1)}, merge="a1", engine_process=False))
    try:
        assert {p.device.type for p in merged.engine.base.parameters()} == {"cpu"}
    finally:
        merged.close()


def test_regress_probe_computes_where_the_stage_was_placed(tiny_with_adapter, monkeypatch):
    """The base probe (held-out perplexity, expert load) asks for the device the regress task
    was given (its GPU when Ray granted one) and computes there; on CPU, as here, that is all
    this checks: the inputs-on-the-model's-device and CPU counts only show on a GPU."""
    from moeflow.evaluation import probe

    base, _, _ = tiny_with_adapter
    asked = []
    monkeypatch.setattr(probe, "local_device", lambda *a: asked.append(1) or torch.device("cpu"))
    out = probe.probe_model(base, ["reverse: abc\nanswer: cba"], ["reverse: abc\nanswer:"])
    assert asked and out["heldout_ppl"] > 1
    assert sum(map(sum, out["expert_load"])) > 0


# ---------------------------------------------------------------- operators on a GPU host


def test_kernel_timings_wait_for_the_gpu(monkeypatch):
    """On CUDA the clock is read after the queued kernels ran (else it times launches only)."""
    from moeflow.operators.opbench import _timed

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))
    _timed(lambda: None, reps=2, min_s=0.001, device="cuda")
    assert len(synced) >= 4  # before and after every rep's calls
    synced.clear()
    _timed(lambda: None, reps=2, min_s=0.001, device="cpu")
    assert synced == []


def _visible(rank, world, port, prefix):
    import os

    from moeflow.operators.dist import _write

    _write(prefix, rank, os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_gloo_ranks_start_with_no_gpu_visible(monkeypatch):
    """The dispatch / EP-load ranks are gloo processes on CPU: on a GPU host they must not see
    the GPUs (transformers would bind each to cuda:LOCAL_RANK); the parent's setting is kept."""
    import os

    from moeflow.operators.dist import _spawn

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _spawn(_visible, 2, ()) == ["", ""]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
