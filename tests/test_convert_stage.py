"""The convert stage as the pipeline runs it (Ray tasks, MLflow run active) and
the `moeflow inspect / convert / export` commands."""

import json
import subprocess
import sys

import mlflow
import pytest
import typer
from typer.testing import CliRunner

from moeflow.core.config import validate
from moeflow_testing.tiny import build_debug_model
from tasks.base import StageContext
from tests.conftest import cli_env

pytestmark = pytest.mark.integration
CORPUS = ["reverse: a b c\nanswer: c b a"] * 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_debug_model("mixtral", tmp_path_factory.mktemp("stage") / "mixtral", corpus=CORPUS)


def test_stage_registered():
    from workflows.dag import registry

    spec = registry()["convert"]
    assert spec.upstream == () and spec.sections == ("model", "convert")


def test_stage_on_ray_logs_to_mlflow(model, tmp_path, ray_local):
    import ray

    from tasks.convert import STAGE

    assert ray.is_initialized()
    cfg = validate({"model": {"path": str(model)}, "convert": {"workers": 2, "checksum": "sha256"}})
    STAGE.preflight(cfg)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    exp = mlflow.create_experiment("convert", artifact_location=str(tmp_path / "artifacts"))
    with mlflow.start_run(experiment_id=exp) as run:
        ctx = StageContext(stage="convert", config=cfg, inputs={}, out_dir=tmp_path / "out",
                           mlflow_run_id=run.info.run_id)
        record = STAGE.run(ctx)
    json.dumps(record)  # small and JSON-able
    assert record["family"] == "mixtral" and record["verified"] and record["mismatches"] == 0
    assert record["logits_max_abs_diff"] == 0.0 and record["source_dir"] == str(model)
    assert (tmp_path / "out" / "converted" / "model-layer-00001.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "converted" / "manifest.json").read_text())["checksum"] == "sha256"
    client = mlflow.tracking.MlflowClient()
    data = client.get_run(run.info.run_id).data
    assert data.metrics["verify.mismatches"] == 0 and data.metrics["convert.tensors"] == record["tensors"]
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "convert")}
    assert {"convert/manifest.json", "convert/verification.json"} <= arts
    mlflow.set_tracking_uri(None)


def test_preflight_refuses_non_checkpoint(tmp_path):
    from moeflow.core.errors import UserError
    from tasks.convert import STAGE

    cfg = validate({"model": {"path": str(tmp_path)}})
    with pytest.raises(UserError, match="no safetensors"):
        STAGE.preflight(cfg)


@pytest.fixture(scope="module")
def app():
    from workflows.commands import convert as commands

    application = typer.Typer()
    commands.register(application)
    return application


def test_cli_inspect_convert_export(model, tmp_path, app):
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(model)])
    assert res.exit_code == 0, res.output
    assert "experts" in res.output and "mixtral" in res.output and "tensors per kind" in res.output
    res = runner.invoke(app, ["inspect", str(model), "--json"])
    summary = json.loads(res.output)
    assert summary["experts"] == 4 and summary["kinds"]["experts"]["tensors"] == 24
    res = runner.invoke(app, ["convert", str(model), str(tmp_path / "c"), "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert "verification: PASSED" in res.output and (tmp_path / "c" / "manifest.json").is_file()
    res = runner.invoke(app, ["export", str(tmp_path / "c"), "--to", "hf", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


def test_cli_bad_input_exits_2_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    (tmp_path / "src" / "model.safetensors").write_bytes(b"\x05")
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "convert", str(tmp_path / "src"),
                           str(tmp_path / "out")], env=cli_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "truncated safetensors file" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.safetensors" in errors[0]
    assert not (tmp_path / "out").exists()


def test_stage_resumes_partial_output_verified_by_checksums(model, tmp_path, monkeypatch):
    """A failed attempt leaves converted files; the next attempt in the same out dir (a Ray
    retry, `moeflow resume`) keeps those whose recorded checksums match, redoes the rest."""
    import moeflow.checkpoint.convert as C
    from tasks.base import NOTES
    from tasks.convert import STAGE

    cfg = validate({"model": {"path": str(model)}, "convert": {"workers": 1}})
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(stage="convert", config=cfg, inputs={}, out_dir=out)
    real = C._write_outputs

    def killed(*args, **kwargs):
        raise RuntimeError("worker lost after the files")

    monkeypatch.setattr(C, "_write_outputs", killed)
    with pytest.raises(RuntimeError, match="worker lost"):
        STAGE.run(ctx)
    partial = out / ".converted.partial"
    files = sorted(partial.glob("model-layer-*.safetensors"))
    assert len(files) >= 2 and all(f.with_name(f.name + ".done.json").is_file() for f in files)
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in a tensor: its checksum no longer matches
    victim.write_bytes(bytes(data))

    monkeypatch.setattr(C, "_write_outputs", real)
    record = STAGE.run(ctx)
    total = record["files"]
    assert record["verified"] and record["resumed_files"] == total - 1
    assert record["headline"]["resumed_files"] == total - 1
    assert (out / NOTES).read_text().strip() == (
        f"resumed: {total - 1} of {total} files kept from the earlier attempt "
        "(their recorded checksums verified)")
    assert STAGE.resumable


def test_cli_inspect_recognises_a_peft_adapter_dir(model, tmp_path, app):
    from moeflow_testing.serving import make_lora_adapter

    adapter = make_lora_adapter(model, tmp_path / "adapter", rank=4)
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(adapter), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["kind"] == "PEFT adapter" and info["rank"] == 4 and info["tensors"] > 0
    assert info["base_model"] and info["bytes"] > 0
    res = runner.invoke(app, ["inspect", str(adapter)])
    assert res.exit_code == 0 and "PEFT adapter" in res.output and "missing" not in res.output
    (adapter / "adapter_model.safetensors").unlink()
    res = runner.invoke(app, ["inspect", str(adapter)])
    assert res.exit_code != 0 and "adapter_model.safetensors" in str(res.exception or res.output)
