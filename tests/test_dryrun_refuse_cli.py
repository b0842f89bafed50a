"""`moeflow run CONFIG --dry-run [--json]` refusing a stage that does not fit its device: exit 2,
one line per stage, no traceback, no priced table; `--json` says the same. Subprocesses, a real
MLflow store. And `moeflow serve` refusing a model larger than one device before Ray starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from moeflow.core.errors import UserError
from tests.conftest import cli_env
from tests.test_dryrun_refuse import spec_file
from workflows.commands.deploy import register

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"


def dry(tmp_path: Path, *sets: str, as_json: bool = False) -> subprocess.CompletedProcess:
    env = cli_env(tmp_path, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    sets = (f"model.path={REPO / 'assets' / 'demo-base'}", f"workdir={tmp_path / 'runs'}", *sets)
    return subprocess.run([sys.executable, "-m", "workflows.cli", "run", str(DEMO), "--dry-run",
                           *(["--json"] if as_json else []), *[a for s in sets for a in ("--set", s)]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_stage_over_its_device_exits_2_naming_it_and_json_says_the_same(tmp_path):
    small = spec_file(tmp_path, "small", 0.0001)  # 100 kB: the demo's whole-model stages do not fit
    proc = dry(tmp_path, f"hardware={small}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "pipeline" not in proc.stdout  # nothing priced
    lines = [ln for ln in proc.stderr.splitlines() if " needs " in ln]
    named = {ln.split(" needs ")[0].removeprefix("error: ").strip() for ln in lines}
    assert {"operators", "calibrate", "regress"} <= named, proc.stderr
    assert all("per device, over 100 KB on small" in ln for ln in lines), lines

    proc = dry(tmp_path, f"hardware={small}", as_json=True)
    assert proc.returncode == 2, proc.stderr
    out = json.loads(proc.stdout)
    assert out["exit_code"] == 2 and {r["stage"] for r in out["refused"]} >= named
    assert [r["message"] for r in out["refused"] if r["stage"] in named] == lines


def test_demo_with_the_vllm_backend_prices_ttft_and_tpot(tmp_path):
    proc = dry(tmp_path, "deploy.backend=vllm", "data.train_file=missing.jsonl", "finetune.adapters={}")
    assert proc.returncode == 0, proc.stderr
    assert "Ray Serve (vllm)" in proc.stdout and "planned prefill" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_moeflow_serve_refuses_a_model_larger_than_one_device_before_ray_starts(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(REPO / "assets" / "demo-base")},
                                      "hardware": str(spec_file(tmp_path, "small", 0.0001))}))
    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(app, ["serve", str(config)])
    assert isinstance(res.exception, UserError), res.output
    assert str(res.exception).startswith("deploy.backend local: the local engine holds the whole model on "
                                         "one device and it needs ")
    assert "over 100 KB per device" in str(res.exception)
