"""The `deploy` stage: merged mode through the stage's pure function on a live
Ray Serve app (smoke test, record, MLflow logging, `openai` client), plus the
stage's and CLI's bad-input checks."""

from __future__ import annotations

import json
import subprocess
import sys

import mlflow
import openai
import pytest
import torch

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from moeflow.serving.app import check_bind
from moeflow.serving.deployment import engine_settings
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model
from tasks.base import StageContext
from tasks.deploy import STAGE, run

PROMPT = "reverse: kqzm\nanswer:"


def _config(tmp_path, uri=None, **deploy):
    return validate({"model": {"path": str(tmp_path / "model")},
                     "tracking": {"uri": uri or f"sqlite:///{tmp_path}/mlflow.db"},
                     "deploy": dict({"port": 0}, **deploy)})


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One sqlite store for the module (creating one costs seconds)."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    mlflow.MlflowClient(uri).search_experiments()  # creates the tables once
    return uri


def test_stage_spec_and_bind_and_serving_config(tmp_path):
    assert STAGE.upstream == ("convert", "plan", "finetune", "regress")
    assert STAGE.after == ("operators", "calibrate", "serving")
    assert set(STAGE.sections) == {"model", "deploy", "lora"}
    with pytest.raises(UserError, match="no API key"):
        check_bind("0.0.0.0", None, False)
    check_bind("0.0.0.0", "k", False)
    check_bind("127.0.0.1", None, False)
    tuned = tmp_path / "serving.yaml"
    tuned.write_text("engine:\n  max_num_seqs: 3\n  max_num_batched_tokens: 64\n")
    knobs = engine_settings(_config(tmp_path, serving_config=str(tuned)))
    assert knobs["max_num_seqs"] == 3 and knobs["max_num_batched_tokens"] == 64 and knobs["max_loras"] == 4
    tuned.write_text("engine:\n  max_num_seq: 3\n")
    with pytest.raises(UserError, match="max_num_seq"):
        engine_settings(_config(tmp_path, serving_config=str(tuned)))


def test_cli_serve_rejects_bad_adapter_flag(tmp_path):
    (tmp_path / "model").mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {tmp_path / 'model'}\n")
    proc = subprocess.run([sys.executable, "-c", "from workflows.cli import main; main()", "serve", str(cfg),
                           "--adapter", "nodir"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "NAME=DIR" in proc.stderr


@pytest.fixture(scope="module")
def merged(ray_local, tmp_path_factory, mlflow_uri):
    """Run the deploy stage in merged mode inside an MLflow run; yield its record."""
    from ray import serve

    tmp = tmp_path_factory.mktemp("deploy")
    base = build_debug_model("qwen3_moe", tmp / "model")
    adapter = make_lora_adapter(base, tmp / "adapter", seed=5)
    cfg = _config(tmp, mlflow_uri, merge=True, served_model_name="tiny")
    ctx = StageContext(stage="deploy", config=cfg, out_dir=tmp / "out",
                       inputs={"convert": {"output_dir": str(base)},
                               "finetune": {"adapter_dir": str(adapter), "adapter_name": "demo"},
                               "regress": {"passed": True}})
    ctx.out_dir.mkdir()
    mlflow.set_tracking_uri(cfg.tracking.uri)
    mlflow.set_experiment("deploy-tests")  # an earlier module's active experiment id is not in this store
    with mlflow.start_run() as active:
        record = run(ctx)
    yield {"record": record, "base": base, "adapter": adapter, "ctx": ctx, "run_id": active.info.run_id}
    serve.shutdown()


def test_merged_deployment_answers_openai_client(merged):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = merged["record"]
    assert record["mode"] == "merged" and record["models"] == ["demo"]
    assert record["smoke"]["completions"]["demo"]["completion_tokens"] >= 1
    saved = json.loads((merged["ctx"].out_dir / "deployment.json").read_text())
    assert saved["url"] == record["url"]
    client = mlflow.MlflowClient(merged["ctx"].config.tracking.uri)
    assert client.get_run(merged["run_id"]).data.tags["moeflow.deploy.url"] == record["url"]
    assert "smoke.json" in {a.path for a in client.list_artifacts(merged["run_id"])}

    tok = AutoTokenizer.from_pretrained(str(merged["base"]))
    ids = torch.tensor([tok(PROMPT).input_ids])
    base = AutoModelForCausalLM.from_pretrained(str(merged["base"]), dtype=torch.float32).eval()
    plain = tok.decode(base.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:],
                       skip_special_tokens=True)
    model = PeftModel.from_pretrained(base, str(merged["adapter"])).merge_and_unload().eval()
    ref = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:],
                     skip_special_tokens=True)
    api = openai.OpenAI(base_url=record["url"] + "/v1", api_key="unused", max_retries=0)
    for name in ("demo", "tiny:demo"):
        out = api.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == ref != plain
    with pytest.raises(openai.NotFoundError, match="demo"):
        api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="merged"):
        api.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": "y"}, cast_to=object)


def test_stage_refuses_failed_regression(tmp_path, merged):
    ctx = StageContext(stage="deploy", config=_config(tmp_path), out_dir=tmp_path,
                       inputs={"convert": {"output_dir": str(merged["base"])}, "finetune": {},
                               "regress": {"passed": False}})
    with pytest.raises(UserError, match="regress"):
        run(ctx)


def test_deploy_run_reads_pipeline_records_from_mlflow(tmp_path, mlflow_uri):
    """`moeflow deploy --run` finds the stage records through the runner's tags and applies
    the serving stage's serving.yaml under the keys the run's config set explicitly."""
    from moeflow.core import tracking as T
    from moeflow.core.config import to_yaml
    from workflows.commands.deploy import _pipeline_inputs

    uri = mlflow_uri
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, tags={T.KIND: "pipeline"}).info.run_id
    client.log_text(parent, to_yaml(_config(tmp_path, uri, max_loras=2)), "config.yaml")
    tuned = tmp_path / "serving.yaml"
    tuned.write_text("engine:\n  max_num_seqs: 3\n  max_loras: 7\n")
    records = {"convert": {"output_dir": "/m"}, "finetune": {"adapter_dir": "/a", "adapter_name": "x"},
               "serving": {"serving_yaml": str(tuned)}}
    for stage, record in records.items():
        out = tmp_path / stage
        out.mkdir()
        (out / "result.json").write_text(json.dumps(record))
        child = client.create_run(exp, tags={T.PARENT: parent, T.STAGE: stage, T.OUT_DIR: str(out)}).info.run_id
        client.set_tag(parent, T.STAGE_RUN_PREFIX + stage, child)
        client.set_tag(parent, T.STATE_PREFIX + stage, "done")
    cfg, got = _pipeline_inputs(parent, uri)
    assert got == records
    assert cfg.deploy.max_loras == 2  # set in the run's config: wins over serving.yaml
    assert cfg.deploy.max_num_seqs == 3  # a default: serving.yaml's value
    client.set_tag(parent, T.STATE_PREFIX + "regress", "failed")
    with pytest.raises(UserError, match="regress"):
        _pipeline_inputs(parent, uri)
    with pytest.raises(UserError):
        _pipeline_inputs(child, uri)  # a stage run is not a pipeline run


def test_registry_adapter_downloads_from_mlflow_model_registry(tmp_path, mlflow_uri, monkeypatch):
    """`models:/name/version` (what finetune registers) resolves to a local PEFT dir."""
    from moeflow.serving.adapters import AdapterRegistry, make_spec

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    uri = mlflow_uri
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("r", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (adapter / "adapter_model.safetensors").write_bytes(b"placeholder")
    client.log_artifacts(run_id, str(adapter), "adapter")
    client.create_registered_model("ad")
    client.create_model_version("ad", source=f"runs:/{run_id}/adapter", run_id=run_id)
    # resolved against the configured store, not MLflow's default one (which would create ./mlflow.db)
    local = AdapterRegistry(None, tmp_path / "dl", tracking_uri=uri).resolve("models:/ad/1")
    assert make_spec("ad", local).rank == 4 and local.is_relative_to(tmp_path / "dl")
    with pytest.raises(UserError, match="MLflow registry"):
        AdapterRegistry(None, tmp_path / "dl", tracking_uri=uri).resolve("models:/ad/7")
    assert list(cwd.iterdir()) == []  # no stray ./mlflow.db from MLflow's default store
    # a replica's registry (no download_dir given): a temporary directory only once it downloads,
    # removed with the registry -- a replica that never downloads leaves nothing in /tmp
    temp = AdapterRegistry(None, tracking_uri=uri, temp_downloads=True)
    assert temp.download_dir is None
    local = temp.resolve("models:/ad/1")
    made = temp.download_dir
    assert made is not None and local.is_relative_to(made) and made.name.startswith("moeflow-adapters-")
    temp.close()
    assert not made.exists()
    with pytest.raises(UserError, match="no download directory"):
        AdapterRegistry(None, tracking_uri=uri).resolve("models:/ad/1")


def test_served_model_uses_the_operators_experts_implementation(tmp_path):
    """The operators stage's serving choice reaches the replica's model (ServeSettings)."""
    from moeflow.serving.app import Service
    from moeflow.serving.deployment import decide
    from moeflow.serving.launch import settings_for

    base = build_debug_model("qwen3_moe", tmp_path / "model")
    operators = {"experts_implementation": {"training": "grouped_mm", "serving": "eager"}}
    dep = decide(_config(tmp_path), {"convert": {"output_dir": str(base)}, "operators": operators})
    settings = settings_for(_config(tmp_path), dep, None)
    assert settings.experts_implementation == "eager"
    assert settings.engine["compile"] is False  # deploy.compile's default: eager decode steps
    assert settings_for(_config(tmp_path, compile=True), dep, None).engine["compile"] is True
    assert settings.engine_process == "auto"  # deploy.engine_process auto: a core process for this text model
    # the model is looked at in process here; a core process loads it with the same load_served
    settings = settings.model_copy(update={"engine_process": False})
    service = Service(settings)
    try:
        assert service.engine.base.config._experts_implementation == "eager"
    finally:
        service.close()
    service = Service(settings.model_copy(update={"experts_implementation": None}))
    try:  # no operators stage: transformers' default
        assert service.engine.base.config._experts_implementation == "grouped_mm"
    finally:
        service.close()
