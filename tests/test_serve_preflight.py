"""`moeflow serve` / `deploy` check the model, its adapters and config.json in the CLI process
before Ray starts: one line naming the file, exit 2, in seconds (a replica's failure costs Ray
Serve three starts, about a minute); what a replica still fails on comes back as its cause."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moeflow.core.errors import UserError
from moeflow.serving.deployment import Deployment
from moeflow.serving.preflight import check_deployment, replica_failure
from tests.conftest import cli_env
from tests.test_config_values import bad_checkpoint  # noqa: F401, F811 - a fixture: num_experts "eight"

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "assets" / "demo-base"


@pytest.fixture(scope="module")
def cases(tmp_path_factory, bad_checkpoint):  # noqa: F811 - the fixture
    """A good adapter, a dir that is none, a truncated shard, a bad config.json, a misfit adapter."""
    import torch
    from safetensors.torch import save_file

    from moeflow_testing.serving import make_lora_adapter

    root = tmp_path_factory.mktemp("preflight")
    good = make_lora_adapter(DEMO, root / "good", experts=True)
    (root / "none").mkdir()
    trunc = root / "trunc"
    shutil.copytree(DEMO, trunc)
    shard = sorted(trunc.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    misfit = root / "misfit"
    misfit.mkdir()
    key = "base_model.model.model.layers.0.self_attn.nope_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, 8), f"{key}.lora_B.weight": torch.zeros(8, 4)},
              str(misfit / "adapter_model.safetensors"))
    (misfit / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                            "target_modules": ["nope_proj"]}))
    return {"good": good, "none": root / "none", "trunc": trunc, "shard": shard, "badcfg": bad_checkpoint,
            "misfit": misfit}


def _dep(base, **adapters) -> Deployment:
    return Deployment(backend="local", checkpoint=str(base), weights="model", adapter=None,
                      adapters={k: str(v) for k, v in adapters.items()})


def test_what_serves_passes(cases):
    check_deployment(_dep(DEMO, a=cases["good"], registered="models:/demo-adapter/3"))


@pytest.mark.parametrize("base, adapter, says", [
    ("demo", "none", "{none}: not a PEFT adapter (no adapter_config.json)"),
    ("trunc", None, "{shard}: truncated"),
    ("badcfg", None, "{badcfg}/config.json: num_experts is 'eight', expected an integer"),
    ("demo", "misfit", "nope_proj, which the base model lacks"),
])
def test_each_cause_is_one_line_naming_the_file(cases, base, adapter, says):
    dep = _dep(DEMO if base == "demo" else cases[base], **({"a": cases[adapter]} if adapter else {}))
    with pytest.raises(UserError) as err:
        check_deployment(dep)
    assert says.format(**cases) in str(err.value) and "\n" not in str(err.value)


def test_a_replicas_traceback_gives_its_last_exception_line():
    message = ("The deployment failed to start 3 times in a row. ... Error:\n"
               "RuntimeError: Traceback (most recent call last):\n"
               '  File "moeflow/serving/core.py", line 410, in _wait_ready\n'
               "    raise UserError(payload)\n"
               "moeflow.core.errors.UserError: /a/adapter_model.safetensors: tensor x targets y\n")
    assert replica_failure(message) == "/a/adapter_model.safetensors: tensor x targets y"
    assert replica_failure(message.replace("moeflow.core.errors.UserError", "torch.OutOfMemoryError")) \
        == "OutOfMemoryError: /a/adapter_model.safetensors: tensor x targets y"
    assert replica_failure("Failed to update the deployments ['MoeflowServer'].") is None


@pytest.fixture(scope="module")
def inspect_s(tmp_path_factory) -> float:
    """Seconds `moeflow inspect` of the demo checkpoint takes on this host now."""
    tmp = tmp_path_factory.mktemp("inspect")
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "workflows.cli", "inspect", str(DEMO)], cwd=tmp, env=cli_env(tmp),
                   capture_output=True, check=True, timeout=120)
    return time.monotonic() - start


@pytest.mark.parametrize("model, adapter, says", [
    ("demo", "none", "not a PEFT adapter (no adapter_config.json)"),
    ("trunc", None, "{shard}: truncated"),
    ("badcfg", None, "'num_experts'"),
])
def test_serve_refuses_before_ray_starts(cases, inspect_s, tmp_path, model, adapter, says):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "name": "s", "model": {"path": str(DEMO if model == "demo" else cases[model])}, "deploy": {"port": 0}}))
    argv = [sys.executable, "-m", "workflows.cli", "serve", "s.yaml"]
    argv += ["--adapter", f"a={cases[adapter]}"] if adapter else []
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    took = time.monotonic() - start
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert says.format(**cases) in lines[0]
    # before Ray (a replica's failure took 48-58 s): within 10 s, or on a busy host as fast
    # as `inspect` reads the same kind of checkpoint there
    assert took < max(10.0, 1.5 * inspect_s), f"{took:.1f} s (inspect {inspect_s:.1f} s)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]  # no MLflow store written here
