"""`moeflow finetune CONFIG`: bad data refused up front (exit 2, file:line); the
real command through the DAG (convert -> plan -> finetune) in the slow tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import cli_env


def _write_config(tmp_path: Path, model: Path, train: Path, eval_: Path, **finetune) -> Path:
    raw = {"name": "clift", "experiment": "clift", "workdir": str(tmp_path / "work"),
           "model": {"path": str(model), "dtype": "float32"},
           "data": {"train_file": str(train), "eval_file": str(eval_), "seq_len": 64},
           "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["attention"]},
           "optimizer": {"lr": 5e-3, "warmup_steps": 1},
           "finetune": {"max_steps": 4, "micro_batch_size": 2, "checkpoint_every": 2,
                        "max_eval_examples": 4, **finetune},
           "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}}
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflows.cli", *args], cwd=tmp_path,
                          env=cli_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def test_bad_line_exits_2_naming_file_and_line(tmp_path):
    from moeflow_testing.tiny import build_debug_model

    model = build_debug_model("qwen3_moe", tmp_path / "model", dtype="float32")
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "a", "completion": " b"}) + "\nnot json\n")
    cfg = _write_config(tmp_path, model, train, train)
    proc = _cli(tmp_path, "finetune", str(cfg))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    assert f"{train}:2: not valid JSON" in err and "Traceback" not in proc.stderr
    assert not (tmp_path / "work").exists()  # refused before any stage ran


@pytest.mark.slow
def test_finetune_command_runs_the_dag(tmp_path):
    from moeflow_testing.demo_data import make_dataset
    from moeflow_testing.tiny import build_debug_model

    model = build_debug_model("qwen3_moe", tmp_path / "model")  # bf16 on disk, as the demo's
    train, eval_ = make_dataset(tmp_path / "data", n_train=80, n_eval=8)
    cfg = _write_config(tmp_path, model, train, eval_)
    proc = _cli(tmp_path, "finetune", str(cfg), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "clift-adapter v1" in out and "exact match base -> adapter" in out
    adapters = list((tmp_path / "work").rglob("adapter/adapter_model.safetensors"))
    assert len(adapters) == 1
