"""Tenant adapters (finetune.adapters): several adapters on one base — trained each in
its own nested MLflow run and registered model, gated one by one in regress, served
together by deploy."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tasks.base import StageContext
from tests.eval_assets import assets, run_regress_in_mlflow

pytestmark = pytest.mark.usefixtures("one_thread")


def _regress(tmp_path: Path, uri: str, tenants: dict):
    cfg = validate({"name": "tenants", "experiment": "tenants", "workdir": str(tmp_path / "w"),
                    "model": {"path": str(assets()["base"]), "dtype": "float32"},
                    "tracking": {"uri": uri}, "regress": {"shards": 1}})
    good = str(assets()["good"])
    adapters = {"main": {"adapter_dir": good, "target_tasks": None, "tenant": False},
                **{name: {"adapter_dir": str(assets()[kind]), "target_tasks": targets, "tenant": True}
                   for name, (kind, targets) in tenants.items()}}
    (tmp_path / "out").mkdir(parents=True)
    ctx = StageContext(stage="regress", config=cfg, out_dir=tmp_path / "out", tracking_uri=uri,
                       inputs={"convert": {"output_dir": str(assets()["base"]), "manifest_sha256": "m" * 64},
                               "finetune": {"adapter_dir": good, "adapters": adapters}})
    return run_regress_in_mlflow(uri, "tenants", ctx)


def test_regress_gates_every_tenant(tmp_path, mlflow_uri, capsys):
    result, run_id = _regress(tmp_path / "a", mlflow_uri, {"rev": ("good", ["reverse_nll"])})
    assert isinstance(result, dict) and result["passed"], result
    out = capsys.readouterr().out
    assert "adapter 'rev' vs base" in out
    metrics = MlflowClient(mlflow_uri).get_run(run_id).data.metrics
    assert "eval_rev/reverse_nll/bits_per_byte" in metrics
    # a damaging tenant fails the stage, named, even though the main adapter is good
    result, _ = _regress(tmp_path / "b", mlflow_uri, {"bad": ("random", [])})
    assert isinstance(result, UserError) and "adapter 'bad'" in str(result)


def test_deploy_serves_every_tenant(tmp_path):
    from moeflow.serving.deployment import decide, tenant_adapters
    from moeflow.serving.launch import settings_for

    record = {"adapter_dir": "/a/main", "adapter_name": "demo-attention-r16",
              "adapters": {"demo-attention-r16": {"adapter_dir": "/a/main", "tenant": False},
                           "reverse": {"adapter_dir": "/a/reverse", "tenant": True}}}
    assert tenant_adapters(record) == {"reverse": "/a/reverse"}
    cfg = validate({"model": {"path": str(tmp_path)}})
    settings = settings_for(cfg, decide(cfg, {"convert": {"output_dir": str(tmp_path)}, "finetune": record}), None)
    assert settings.adapters == {"demo-attention-r16": "/a/main", "reverse": "/a/reverse"}


def test_finetune_trains_each_tenant_in_its_own_run(tmp_path, ray_local):
    """The main adapter and a tenant on its own data: two adapters, the tenant in a nested
    MLflow run (FINISHED, with its training metrics) and its own registered model."""
    from tasks.finetune import run
    from tests.test_finetune_stage import make_assets, make_config, make_ctx, start_run

    assets_ = make_assets(tmp_path / "assets")
    rev_train = assets_["train"].with_name("train-reverse.jsonl")
    cfg = make_config(assets_, tmp_path, finetune={"max_steps": 3, "adapters": {
        "rev": {"train_file": str(rev_train), "max_steps": 2, "target_tasks": ["reverse_nll"]}}})
    run_id = start_run(cfg.tracking.uri, tmp_path)
    record = run(make_ctx(cfg, assets_, tmp_path / "out", run_id))
    adapters = record["adapters"]
    assert list(adapters) == [record["adapter_name"], "rev"]
    assert adapters["rev"]["tenant"] and not adapters[record["adapter_name"]]["tenant"]
    rev_dir = Path(adapters["rev"]["adapter_dir"])
    assert (rev_dir / "adapter_model.safetensors").is_file() and rev_dir != Path(record["adapter_dir"])
    assert (rev_dir / "adapter_model.safetensors").read_bytes() != \
        (Path(record["adapter_dir"]) / "adapter_model.safetensors").read_bytes()
    client = MlflowClient(cfg.tracking.uri)
    child = client.search_runs([client.get_run(run_id).info.experiment_id],
                               filter_string="tags.`moeflow.adapter` = 'rev'")[0]
    assert child.data.tags["mlflow.parentRunId"] == run_id and child.info.status == "FINISHED"
    assert child.data.params["max_steps"] == "2" and any(k.startswith("train/") for k in child.data.metrics)
    assert adapters["rev"]["registered_model"] == "fttest-rev" and adapters["rev"]["model_version"] == "1"


def test_preflight_refuses_bad_tenant_names(tmp_path):
    from tasks.finetune import STAGE

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": " b"}\n')
    base = {"name": "t", "model": {"path": str(tmp_path / "none")}, "data": {"train_file": str(data)}}
    for name, message in (("bad name!", "lora_name 'bad name!'"), ("t-attention-r16", "already has this name")):
        cfg = validate({**base, "finetune": {"adapters": {name: {"train_file": str(data)}}}})
        with pytest.raises(UserError, match=message):
            STAGE.preflight(cfg)
    missing = validate({**base, "finetune": {"adapters": {"ok": {"train_file": str(tmp_path / "nope.jsonl")}}}})
    with pytest.raises(UserError, match="nope.jsonl"):
        STAGE.preflight(missing)


def _job(cfg, name: str, train_file):
    from transformers import AutoTokenizer

    from moeflow.training import data as D
    from moeflow.training.worker import AdapterJob

    data = cfg.data.model_copy(update={"train_file": str(train_file)})
    ds = D.build_dataset(data, AutoTokenizer.from_pretrained(cfg.model.path), cfg.seed)
    return AdapterJob(name, cfg.finetune, ds)


def _train(w, steps: int) -> dict:
    from moeflow.training import trainer as TR

    for _ in range(steps):
        TR._train_step(w)
    return {n: p.detach().clone() for n, p in w.model.named_parameters() if p.requires_grad}


def test_adapters_trained_in_turn_on_one_base_equal_each_trained_alone(tmp_path):
    """The finetune worker trains the main adapter and then each tenant on the base it loaded
    once (PEFT unload between): the tenant must come out as from a worker of its own, and
    the base must be untouched by the adapter before it."""
    import torch

    from moeflow.training import trainer as TR
    from moeflow.training.worker import WorkerConfig
    from tests.test_finetune_stage import make_assets, make_config

    a = make_assets(tmp_path / "assets")
    rev = a["train"].with_name("train-reverse.jsonl")
    cfg = make_config(a, tmp_path, model={"path": str(a["converted"])})
    wcfg = WorkerConfig.build(cfg, a["converted"])
    base = TR._load(wcfg, 0, 1)
    before = {n: p.clone() for n, p in base.model.named_parameters()}
    first = TR._setup(wcfg, base, _job(cfg, "main", a["train"]))
    _train(first, 3)
    TR._release(first, base)
    assert {n: p for n, p in base.model.named_parameters()}.keys() == before.keys()
    assert all(torch.equal(p, before[n]) for n, p in base.model.named_parameters())
    in_turn = _train(TR._setup(wcfg, base, _job(cfg, "rev", rev)), 3)
    alone = _train(TR._setup(wcfg, TR._load(wcfg, 0, 1), _job(cfg, "rev", rev)), 3)
    assert in_turn.keys() == alone.keys() and in_turn
    for name in alone:
        torch.testing.assert_close(in_turn[name], alone[name], rtol=0, atol=0)


def test_latest_checkpoint_names_the_adapter_it_was_taken_in(tmp_path):
    """What a restored run resumes from: the checkpoint Ray Train's snapshot registered last
    (not a newer directory the workers of a killed driver uploaded unregistered)."""
    import json

    from moeflow.training.driver import latest_checkpoint, latest_checkpoint_step

    run = tmp_path / "ray" / "finetune"

    def ckpt(name: str, progress: dict, finished=(), state=True, register=True):
        d = run / name
        d.mkdir(parents=True)
        (d / "PROGRESS.json").write_text(json.dumps(progress))
        if state:
            (d / "trainer_state.json").write_text("{}")
        for f in finished:
            (d / "jobs" / f).mkdir(parents=True)
        if register:  # the part of Ray Train's snapshot that names the latest checkpoint
            (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(
                {"latest_checkpoint_result": {"checkpoint_dir_name": name, "metrics": {}}}))

    assert latest_checkpoint(tmp_path / "ray") is None
    ckpt("checkpoint_b", {"job": "main", "step": 40, "seq": 2}, register=False)
    assert latest_checkpoint(tmp_path / "ray") is None  # nothing registered: Ray starts afresh
    ckpt("checkpoint_a", {"job": "main", "step": 60, "seq": 3}, state=False, finished=["main"])
    assert latest_checkpoint(tmp_path / "ray") == {"job": None, "step": None, "finished": ["main"]}
    ckpt("checkpoint_c", {"job": "rev", "step": 20, "seq": 4}, finished=["main"])
    assert latest_checkpoint(tmp_path / "ray") == {"job": "rev", "step": 20, "finished": ["main"]}
    ckpt("checkpoint_d", {"job": "rev", "step": 40, "seq": 5}, finished=["main"], register=False)
    assert latest_checkpoint_step(tmp_path / "ray") == 20  # uploaded after the driver died
    (run / "checkpoint_manager_snapshot.json").write_text("{")  # torn
    assert latest_checkpoint(tmp_path / "ray") is None


def test_a_resumed_stage_closes_the_lost_attempts_tenant_run(tmp_path):
    """A tenant's MLflow run left RUNNING by a killed driver is closed KILLED when the stage
    runs again in the same out dir; the new attempt logs into a new nested run."""
    from tasks.finetune import _tenant_run
    from tests.test_finetune_stage import make_assets, make_config, make_ctx, start_run

    a = make_assets(tmp_path / "assets")
    cfg = make_config(a, tmp_path)
    run_id = start_run(cfg.tracking.uri, tmp_path)
    ctx = make_ctx(cfg, a, tmp_path / "out", run_id)
    spec = validate({**cfg.model_dump(mode="json"), "finetune": {"adapters": {
        "rev": {"train_file": str(a["train"])}}}}).finetune.adapters["rev"]
    out = tmp_path / "out" / "adapters" / "rev"
    first = _tenant_run(ctx, "rev", spec, cfg, out)
    second = _tenant_run(ctx, "rev", spec, cfg, out)
    client = MlflowClient(cfg.tracking.uri)
    assert first != second
    assert client.get_run(first).info.status == "KILLED"
    new = client.get_run(second)
    assert new.info.status == "RUNNING" and new.data.tags["mlflow.parentRunId"] == run_id
    assert (out / "mlflow_run_id").read_text() == second
