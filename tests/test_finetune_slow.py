"""Slow finetune checks: a killed worker is survived, expert LoRA end to end, it learns.

    pytest -m slow tests/test_finetune_slow.py
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.test_finetune_stage import make_assets, make_config, make_ctx, start_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("fts"))


def _kill_rank1_after(out: Path, killed: dict, deadline: float) -> None:
    """Once Ray Train has registered a checkpoint, SIGKILL the rank-1 worker process.

    The controller writes its checkpoint-manager snapshot when it registers a
    reported checkpoint; killing before that would (rightly) restart from scratch.
    """
    snapshot = out / "ray" / "finetune" / "checkpoint_manager_snapshot.json"
    pid_file = out / "workers" / "rank1.pid"
    while time.time() < deadline:
        if snapshot.exists() and pid_file.exists():
            pid = int(pid_file.read_text())
            step = json.loads((out / "workers" / "progress.json").read_text())["step"]
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, step=step)
            return
        time.sleep(0.05)


def test_killed_worker_resumes_from_checkpoint(assets, tmp_path, ray_local):
    from tasks.finetune import run

    cfg = make_config(assets, tmp_path, finetune={
        "max_steps": 80, "checkpoint_every": 4, "max_failures": 2, "micro_batch_size": 2})
    ctx = make_ctx(cfg, assets, tmp_path / "out")
    killed: dict = {}
    killer = threading.Thread(target=_kill_rank1_after,
                              args=(tmp_path / "out", killed, time.time() + 600))
    killer.start()
    record = run(ctx)
    killer.join()
    assert killed, "the worker was never killed"
    m = record["metrics"]
    assert m["step"] == 80 and m.get("restarts") == 1, m
    assert 4 <= m["resumed_from_step"] <= killed["step"]
    assert (Path(record["adapter_dir"]) / "adapter_model.safetensors").is_file()
    new_pid = int((tmp_path / "out" / "workers" / "rank1.pid").read_text())
    assert new_pid != killed["pid"]  # a fresh worker finished the run


def _kill_rank1_in_tenant(out: Path, tenant: str, killed: dict, deadline: float) -> None:
    """SIGKILL the rank-1 worker once Ray Train has registered a checkpoint taken while
    training `tenant` (the run had finished the main adapter before it)."""
    snapshot = out / "ray" / "finetune" / "checkpoint_manager_snapshot.json"
    pid_file = out / "workers" / "rank1.pid"
    while time.time() < deadline:
        for progress in (out / "ray" / "finetune").glob("checkpoint_*/PROGRESS.json"):
            try:
                meta = json.loads(progress.read_text())
                registered = snapshot.is_file() and progress.parent.name in snapshot.read_text()
            except (OSError, ValueError):
                continue
            if meta.get("job") == tenant and registered and (progress.parent / "trainer_state.json").is_file():
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, step=meta["step"])
                return
        time.sleep(0.05)


def test_worker_killed_in_a_tenant_resumes_it_and_keeps_the_main_adapter(assets, tmp_path, ray_local):
    """One Ray Train run trains the main adapter, then the tenant; a worker killed in the
    tenant's training restarts the run from the tenant's checkpoint: the main adapter is not
    trained again, the tenant continues from its step."""
    from tasks.finetune import run

    rev = assets["train"].with_name("train-reverse.jsonl")
    cfg = make_config(assets, tmp_path, finetune={
        "max_steps": 8, "checkpoint_every": 4, "max_failures": 2, "micro_batch_size": 2,
        "adapters": {"rev": {"train_file": str(rev), "max_steps": 80}}})
    run_id = start_run(cfg.tracking.uri, tmp_path)
    out = tmp_path / "out"
    killed: dict = {}
    killer = threading.Thread(target=_kill_rank1_in_tenant,
                              args=(out, "rev", killed, time.time() + 600))
    killer.start()
    record = run(make_ctx(cfg, assets, out, run_id))
    killer.join()
    assert killed, "the worker was never killed in the tenant's training"
    main, rev_m = record["metrics"], record["adapters"]["rev"]["metrics"]
    assert main["step"] == 8 and "restarts" not in main, main  # finished before the kill: kept
    assert rev_m["step"] == 80 and rev_m["restarts"] == 1, rev_m
    assert 4 <= rev_m["resumed_from_step"] <= killed["step"] and rev_m["resumed_from_step"] % 4 == 0
    assert int((out / "workers" / "rank1.pid").read_text()) != killed["pid"]
    for adapter in (record["adapter_dir"], record["adapters"]["rev"]["adapter_dir"]):
        assert (Path(adapter) / "adapter_model.safetensors").is_file()
    assert not (out / "ray").exists()  # every record written: the run's checkpoints are gone


def test_expert_lora_end_to_end(assets, tmp_path, ray_local):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tasks.finetune import run

    cfg = make_config(assets, tmp_path, lora={"target_modules": ["attention", "experts"],
                                              "dropout": 0.0})
    run_id = start_run(cfg.tracking.uri, tmp_path)
    record = run(make_ctx(cfg, assets, tmp_path / "out", run_id))
    assert record["targets"]["experts"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    conf = json.loads((Path(record["adapter_dir"]) / "adapter_config.json").read_text())
    assert sorted(conf["target_parameters"]) == record["targets"]["experts"]
    base = AutoModelForCausalLM.from_pretrained(assets["original"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, record["adapter_dir"]).eval()
    probe = load_file(record["probe_path"])
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits  # [1, S, V]
    torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=1e-4)
    assert record["metrics"]["comm_bytes_per_step"] == record["metrics"]["lora_bytes"]


def test_it_learns_the_demo_task(tmp_path, ray_local):
    """The demo's settings (configs/demo.yaml): held-out exact match far above the base."""
    from moeflow_testing.demo_data import make_dataset
    from moeflow_testing.tiny import build_debug_model
    from tasks.finetune import run

    model = build_debug_model("qwen3_moe", tmp_path / "model")  # as `moeflow demo` builds it
    train, eval_ = make_dataset(tmp_path / "data", seed=0)
    assets = {"original": model, "converted": model, "train": train, "eval": eval_}
    cfg = make_config(assets, tmp_path,
                      lora={"rank": 16, "alpha": 32},
                      optimizer={"lr": 3e-2, "warmup_steps": 10},
                      finetune={"max_steps": 800, "micro_batch_size": 4, "checkpoint_every": 200,
                                "max_eval_examples": 200})
    m = run(make_ctx(cfg, assets, tmp_path / "out"))["metrics"]
    assert m["base_exact_match/min"] == 0.0
    assert m["adapter_exact_match/min"] >= 0.4, m
    assert m["eval_loss"] < 5.75
