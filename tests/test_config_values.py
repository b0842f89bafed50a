"""A checkpoint config.json value transformers' config class refuses (`num_experts: "eight"`) is
one line naming the key and the value, exit 2, in every command that reads it: inspect, convert,
serve, run (before any MLflow run), and the library paths they share."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moeflow.core.errors import UserError
from tests.conftest import cli_env

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "assets" / "demo-base"


@pytest.fixture(scope="module")
def bad_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("badcfg")
    out = root / "ckpt"
    out.mkdir()
    for f in DEMO.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((DEMO / "config.json").read_text())
    cfg.pop("num_local_experts", None)
    cfg["num_experts"] = "eight"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "num_experts" in lines[0] and "'eight'" in lines[0] and "config.json" in lines[0], err
    return lines[0]


def test_library_paths_say_it_in_one_line(bad_checkpoint):
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.model.anatomy import check_config_values
    from moeflow.model.models import load_model

    raw = json.loads((bad_checkpoint / "config.json").read_text())
    for call in (lambda: check_config_values(raw, "x/config.json"), lambda: read_checkpoint(bad_checkpoint),
                 lambda: load_model(bad_checkpoint, "float32")):
        with pytest.raises(UserError) as err:
            call()
        _line(str(err.value))
    check_config_values(json.loads((DEMO / "config.json").read_text()))  # the good one passes


@pytest.mark.parametrize("args", [["inspect", "{ckpt}"], ["convert", "{ckpt}", "{tmp}/out"],
                                  pytest.param(["run", "{tmp}/p.yaml"], marks=pytest.mark.slow),
                                  pytest.param(["serve", "{tmp}/p.yaml"], marks=pytest.mark.slow)])
def test_every_command_exits_2_with_one_line(bad_checkpoint, tmp_path, args):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({
        "name": "bad", "model": {"path": str(bad_checkpoint)}, "data": {"train_file": str(tmp_path / "t.jsonl")},
        "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"}, "deploy": {"port": 0}}))
    (tmp_path / "t.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    argv = [a.format(ckpt=bad_checkpoint, tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", *argv], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _line(proc.stderr)
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert not (tmp_path / "m.db").exists() or args[0] != "run"  # refused before any MLflow run


@pytest.mark.parametrize("key, value", [("num_local_experts", "eight"), ("num_experts_per_tok", 2.5),
                                        ("num_local_experts", True)])
def test_an_expert_count_a_config_class_does_not_declare_is_still_checked(key, value):
    """Qwen3-MoE's config class has num_experts; the demo's config.json also says num_local_experts,
    which the class keeps as it is: `inspect` showed "experts None" and exited 0."""
    from moeflow.model.anatomy import check_config_values

    raw = json.loads((DEMO / "config.json").read_text())
    with pytest.raises(UserError, match=f"x/config.json: {key} is {value!r}, expected an integer"):
        check_config_values(raw | {key: value}, "x/config.json")
