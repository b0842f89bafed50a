"""Config schema: presets load, overrides apply, bad keys are named."""

import json
import subprocess
import sys

import pytest
import yaml

from moeflow.core.config import apply_overrides, load_config, validate
from moeflow.core.errors import UserError
from tests.conftest import REPO, cli_env

PRESETS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_and_starts_with_its_command(path):
    cfg = load_config(path)
    assert cfg.model.path
    assert path.read_text().startswith("# moeflow "), "presets start with the command that runs them"


def test_seed_config_loads_unchanged():
    cfg = load_config(REPO / "configs" / "reference-2.8t.yaml")
    assert cfg.model.path == "/models/2.8t-moe"
    assert cfg.model.dtype == "bfloat16" and cfg.model.freeze_base is True
    assert cfg.parallel.tensor_parallel == 8 and cfg.parallel.expert_parallel == 16
    assert cfg.parallel.pipeline_parallel == "auto"
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (64, 128, 0.05)
    assert cfg.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cfg.data.train_file == "/data/train.jsonl" and cfg.data.seq_len == 32768
    assert cfg.optimizer.lr == pytest.approx(1e-4) and cfg.optimizer.weight_decay == 0.01


def test_overrides_nested_and_typed(tmp_path):
    raw = {"model": {"path": "/m"}, "parallel": "auto"}
    raw = apply_overrides(raw, ["lora.rank=16", "parallel.tensor_parallel=2",
                                "data.train_file=/d/t.jsonl", "lora.target_modules=[q_proj, v_proj]"])
    cfg = validate(raw)
    assert cfg.lora.rank == 16 and isinstance(cfg.lora.rank, int)
    assert cfg.parallel.tensor_parallel == 2 and cfg.parallel.expert_parallel == "auto"
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.data.train_file == "/d/t.jsonl"


def test_override_without_equals_is_an_error():
    with pytest.raises(UserError, match="KEY=VALUE"):
        apply_overrides({}, ["lora.rank"])


def test_unknown_key_names_it_and_nearest(tmp_path):
    with pytest.raises(UserError) as err:
        validate({"model": {"path": "/m"}, "lora": {"rnak": 4}})
    assert "`lora.rnak`" in str(err.value) and "did you mean `lora.rank`" in str(err.value)
    with pytest.raises(UserError, match="did you mean `optimizer`"):
        validate({"model": {"path": "/m"}, "optimiser": {}})


def test_wrong_type_names_the_key():
    with pytest.raises(UserError) as err:
        validate({"model": {"path": "/m"}, "parallel": {"tensor_parallel": "eight"}})
    msg = str(err.value)
    assert "`parallel.tensor_parallel`" in msg and "'eight'" in msg
    with pytest.raises(UserError, match="`lora.dropout`"):
        validate({"model": {"path": "/m"}, "lora": {"dropout": 2}})
    with pytest.raises(UserError, match="missing required key `model`"):
        validate({})


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: /x\n lora: [\n")
    with pytest.raises(UserError, match=rf"{path}:\d+: invalid YAML"):
        load_config(path)


def _cli(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "workflows.cli", *args], cwd=tmp_path,
                          env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)


def test_cli_seed_config_fails_cleanly_on_missing_model(tmp_path):
    proc = _cli(["run", str(REPO / "configs" / "reference-2.8t.yaml")], tmp_path)
    assert proc.returncode == 2
    assert "model path not found: /models/2.8t-moe" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_unknown_key_exits_nonzero_and_starts_no_run(tmp_path):
    cfg = tmp_path / "bad.yaml"
    db = tmp_path / "mlflow.db"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(tmp_path)}, "lora": {"rnak": 4},
                                   "tracking": {"uri": f"sqlite:///{db}"}}))
    proc = _cli(["run", str(cfg)], tmp_path)
    assert proc.returncode == 2
    assert "unknown key `lora.rnak`" in proc.stderr and "Traceback" not in proc.stderr
    if db.exists():  # nothing may be left RUNNING (nothing should exist at all)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{db}")
        exps = [e.experiment_id for e in client.search_experiments()]
        assert not exps or not client.search_runs(exps)


@pytest.mark.slow  # ~50 s of the default suite on 2 cores (`moeflow run` of the reference's plan on Ray)
@pytest.mark.ci
def test_cli_reference_config_runs_the_plan_stage_without_its_checkpoint(tmp_path):
    """`moeflow run configs/reference-2.8t.yaml --stages plan`: the checkpoint is absent, the
    plan stage plans from plan.architecture through Ray and MLflow (a plain directory as
    tracking.uri becomes a sqlite store in it)."""
    store = tmp_path / "store"
    proc = _cli(["run", str(REPO / "configs" / "reference-2.8t.yaml"), "--stages", "plan",
                 "--set", f"workdir={tmp_path / 'w'}", "--set", f"tracking.uri={store}"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plan" in proc.stdout and "FINISHED" in proc.stdout
    assert (store / "mlflow.db").is_file()
    plan = json.loads(next((tmp_path / "w").rglob("plan.json")).read_text())
    assert plan["num_workers"] == 384 and plan["tensor_parallel"] == 8  # as written
    assert plan["workload"]["seq_len"] == 32768 and plan["recompute"] is True
    assert any("recompute per layer" in n for n in plan["notes"])
    # a stage that reads the checkpoint is still refused up front, naming itself
    proc = _cli(["run", str(REPO / "configs" / "reference-2.8t.yaml"), "--stages", "finetune",
                 "--set", f"tracking.uri={store}"], tmp_path)
    assert proc.returncode == 2 and "read by convert" in proc.stderr


def test_enable_only_takes_hard_upstreams_not_optional_ones(tmp_path):
    from workflows.selection import enable_only

    cfg = load_config(REPO / "configs" / "demo.yaml", [])
    assert enable_only(cfg, ["plan"]).stages.enabled == ["plan"]
    assert enable_only(cfg, ["finetune"]).stages.enabled == ["convert", "plan", "finetune"]
    assert set(enable_only(cfg, ["finetune", "operators"]).stages.enabled) == {
        "convert", "plan", "operators", "finetune"}
    with pytest.raises(UserError, match="--stages.*nope"):
        enable_only(cfg, ["nope"])
    off = cfg.model_copy(update={"stages": cfg.stages.model_copy(update={"enabled": ["plan"]})})
    with pytest.raises(UserError, match="convert, finetune needed but not in stages.enabled"):
        enable_only(off, ["finetune"])
