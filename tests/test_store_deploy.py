"""`moeflow deploy --run RUN` of a run whose workdir is in object storage (moto's S3 server):
the stage records, the serving stage's serving.yaml, the base and the adapter are all read
through the store layer, and the endpoint answers a real request with the run's adapter."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from moeflow.core import storage
from moeflow_testing.serving import make_lora_adapter
from tests.conftest import BIN, REPO, cli_env
from tests.s3server import BUCKET, s3_server

pytestmark = pytest.mark.integration
BASE = REPO / "assets" / "demo-base"


def _stage(tmp_path: Path, run_dir: str, stage: str, files, record) -> str:
    """Publish a stage output (its files, then result.json naming store URIs) under `run_dir`."""
    out = f"{run_dir}/{stage}-1"
    local = tmp_path / f"out-{stage}"
    local.mkdir()
    files(local)
    (local / "result.json").write_text(json.dumps(record(out)))
    storage.publish(local, out)
    return out


def _store_run(tmp_path: Path, uri: str, workdir: str) -> str:
    """A finished pipeline run in MLflow whose convert, finetune and serving outputs are in the store."""
    from mlflow.tracking import MlflowClient

    from moeflow.core import tracking as T
    from moeflow.core.config import to_yaml, validate
    from tests.test_vllm_backend import _plan

    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("s3", artifact_location=f"{workdir}/mlflow-artifacts")
    parent = client.create_run(exp, tags={T.KIND: "pipeline"}).info.run_id
    cfg = validate({"name": "s3", "workdir": workdir, "model": {"path": str(BASE)}, "tracking": {"uri": uri},
                    "deploy": {"port": 0, "num_replicas": 1, "num_cpus": 1}})
    client.log_text(parent, to_yaml(cfg), "config.yaml")
    run_dir = f"{workdir}/{parent}"
    outs = {
        "convert": _stage(tmp_path, run_dir, "convert", lambda d: shutil.copytree(BASE, d / "converted"),
                          lambda out: {"output_dir": f"{out}/converted"}),
        "finetune": _stage(tmp_path, run_dir, "finetune",
                           lambda d: make_lora_adapter(BASE, d / "adapter", seed=2),
                           lambda out: {"adapter_dir": f"{out}/adapter", "adapter_name": "s3-tenant"}),
        "operators": _stage(tmp_path, run_dir, "operators", lambda d: (d / "operators.json").write_text(
            json.dumps({"model_dir": f"{run_dir}/convert-1/converted", "placement": {
                "eplb": {"layout": {"ep": 2, "redundant": 0}}, "permutation": {"perms": None}}})),
            lambda out: {"operators_path": f"{out}/operators.json"}),
        "serving": _stage(tmp_path, run_dir, "serving",
                          lambda d: (d / "serving.yaml").write_text("engine:\n  max_num_seqs: 3\n"),
                          lambda out: {"serving_yaml": f"{out}/serving.yaml"}),
    }
    outs["plan"] = _stage(tmp_path, run_dir, "plan", lambda d: None, lambda out: _plan(tmp_path, BASE))
    for stage, out in outs.items():
        child = client.create_run(exp, tags={T.PARENT: parent, T.STAGE: stage, T.OUT_DIR: out}).info.run_id
        client.set_tag(parent, T.STAGE_RUN_PREFIX + stage, child)
        client.set_tag(parent, T.STATE_PREFIX + stage, "done")
    return parent


@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    """moto's server (its AWS_* environment set here, so this process reads the store too) and
    a pipeline run stored in it: (env, tracking URI, run id, tmp dir)."""
    tmp = tmp_path_factory.mktemp("store-run")
    saved = dict(os.environ)
    with s3_server() as env:
        os.environ.update(env, MOEFLOW_SCRATCH=str(tmp / "scratch"))
        try:
            uri = f"sqlite:///{tmp}/mlflow.db"
            yield env, uri, _store_run(tmp, uri, f"s3://{BUCKET}/work"), tmp
        finally:
            os.environ.clear()
            os.environ.update(saved)


def test_a_store_runs_records_and_serving_yaml_are_read_through_the_store(store_run, tmp_path):
    from moeflow.core.errors import UserError
    from moeflow.serving.deployment import read_serving_yaml
    from workflows.commands.deploy import _pipeline_inputs

    _, uri, run_id, _ = store_run
    cfg, records = _pipeline_inputs(run_id, uri)
    assert records["convert"]["output_dir"].startswith(f"s3://{BUCKET}/work/{run_id}/")
    assert cfg.deploy.max_num_seqs == 3  # the serving stage's serving.yaml, read from the store
    missing = f"s3://{BUCKET}/work/{run_id}/serving-1/nope.yaml"
    with pytest.raises(UserError, match=rf"^deploy.serving_config: {missing}: not in the output's _manifest"):
        read_serving_yaml(missing)
    with pytest.raises(UserError, match=r"^deploy.serving_config: 's3:/moeflow/x.yaml' is not a URI"):
        read_serving_yaml("s3:/moeflow/x.yaml")


def test_vllm_serve_config_of_a_store_run(store_run, tmp_path):
    """`deploy --run --backend vllm --dry-run` of a stored run: the adapters are read from the
    store (their adapter_config.json decides how vLLM serves them), the base is named by URI."""
    import typer
    import yaml
    from typer.testing import CliRunner

    from moeflow.serving.vllm_backend import validate_serve_config
    from workflows.commands.deploy import register

    _, uri, run_id, _ = store_run
    app = typer.Typer()
    register(app)
    target = tmp_path / "serve.yaml"
    res = CliRunner().invoke(app, ["deploy", "--run", run_id, "--tracking-uri", uri, "--backend", "vllm",
                                   "--dry-run", "--out", str(target), "--lora-uri", f"s3://{BUCKET}/lora"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert "s3-tenant: served as" in res.output
    (llm,) = validate_serve_config(yaml.safe_load(target.read_text()))
    source = llm.model_loading_config.model_source  # Ray Serve LLM's cloud mirror of the base
    assert source.bucket_uri == f"s3://{BUCKET}/work/{run_id}/convert-1/converted"


def test_the_deploying_process_fetches_only_the_bases_config(store_run, tmp_path, monkeypatch):
    """Before Serve starts, the base is checked from its config.json alone: a base in a store is
    not downloaded whole by the process that deploys it (its replicas fetch it on their nodes)."""
    from moeflow.core.errors import UserError
    from moeflow.serving.app import check_base
    from moeflow.serving.settings import ServeSettings

    _, _, run_id, _ = store_run
    monkeypatch.setenv("MOEFLOW_SCRATCH", str(tmp_path / "fresh"))
    converted = f"s3://{BUCKET}/work/{run_id}/convert-1/converted"
    check_base(ServeSettings(base_dir=converted))
    fetched = [p.name for p in (tmp_path / "fresh").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert fetched == ["config.json"]
    with pytest.raises(UserError, match=rf"^s3://{BUCKET}/work/{run_id}/serving-1: not a model directory"):
        check_base(ServeSettings(base_dir=f"s3://{BUCKET}/work/{run_id}/serving-1"))


def test_watch_gates_an_adapter_on_a_base_dir_tag_naming_a_store_uri(store_run):
    from types import SimpleNamespace

    from moeflow.ops.watch import MissingTag, _base_dir

    _, _, run_id, _ = store_run
    converted = f"s3://{BUCKET}/work/{run_id}/convert-1/converted"
    local = _base_dir(SimpleNamespace(tags={"base_dir": converted}))
    assert json.loads((Path(local) / "config.json").read_text()) == json.loads((BASE / "config.json").read_text())
    with pytest.raises(MissingTag, match=r"^base_dir s3://.*/nope: .*set the version's base_dir tag"):
        _base_dir(SimpleNamespace(tags={"base_dir": f"s3://{BUCKET}/work/{run_id}/nope"}))


def test_rebalance_reads_a_store_runs_placement_through_the_store(store_run):
    from moeflow.ops.rebalance import _readable, original_dir, run_inputs

    _, uri, run_id, _ = store_run
    inputs = run_inputs(run_id, uri)
    converted = f"s3://{BUCKET}/work/{run_id}/convert-1/converted"
    assert inputs["model_dir"] == converted and inputs["layout"]["ep"] == 2
    config = json.loads(Path(_readable(f"{converted}/config.json", run_id)).read_text())
    assert config["model_type"] == json.loads((BASE / "config.json").read_text())["model_type"]
    assert original_dir(converted) == converted  # not a permuted checkpoint: served as is


@pytest.mark.slow
def test_deploy_run_of_a_run_in_object_storage_serves(store_run, tmp_path):
    env, uri, run_id, _ = store_run
    proc = subprocess.Popen([str(BIN / "moeflow"), "deploy", "--run", run_id, "--tracking-uri", uri],
                            env=cli_env(tmp_path, **env, MOEFLOW_SCRATCH=str(tmp_path / "cli-scratch")),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        url = _wait_url(proc, lines, timeout=300)
        out = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "s3-tenant", "prompt": "reverse: abc\nanswer:", "max_tokens": 4, "temperature": 0})
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["completion_tokens"] >= 1
        models = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
        assert models == ["demo-base", "s3-tenant"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # the replica read the run's files from the store, into its node's cache
    assert list((tmp_path / "cli-scratch" / "cache").rglob("adapter_config.json"))


def _wait_url(proc: subprocess.Popen, lines: list[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"OpenAI base URL: (\S+)/v1", "".join(lines))
        if found:
            return found.group(1)
        if proc.poll() is not None:
            time.sleep(0.2)  # the reader thread's last lines
            raise AssertionError(f"deploy exited {proc.returncode}: {''.join(lines)[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no endpoint within {timeout:.0f} s: {''.join(lines)[-3000:]}")


def test_finetune_tags_registered_versions_with_store_uris(store_run, tmp_path, monkeypatch):
    """With the workdir in a store, the finetune stage works on a node-local copy of the
    converted base; the registered version's base_dir tag (what `moeflow watch` gates it on)
    names the base's store URI, never that copy. Training itself is replaced by a fixed
    adapter here: what is checked is what the stage records around it."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from moeflow.core.config import validate
    from moeflow.training import driver
    from tasks.base import StageContext
    from tasks.finetune import run as finetune

    _, uri, run_id, _ = store_run
    converted = f"s3://{BUCKET}/work/{run_id}/convert-1/converted"
    local_base = storage.localize(converted)  # what the runner hands the stage

    def trained(jobs, base_dir, plan, **_):
        assert base_dir == local_base
        return [{"adapter_dir": str(make_lora_adapter(BASE, job.out_dir / "adapter", seed=4)),
                 "metrics": {"eval_loss": 1.0}, "dataset": {"sha256": "d" * 64}, "targets": [],
                 "probe_path": None, "num_workers": 1} for job in jobs]

    monkeypatch.setattr(driver, "train_adapters", trained)
    out = tmp_path / "finetune"
    out.mkdir()
    cfg = validate({"name": "s3", "model": {"path": str(BASE)}, "tracking": {"uri": uri},
                    "data": {"train_file": str(tmp_path / "unused.jsonl")}})
    mlflow.set_tracking_uri(uri)
    exp = mlflow.create_experiment("ft", artifact_location=str(tmp_path / "artifacts"))
    with mlflow.start_run(experiment_id=exp) as active:
        ctx = StageContext(stage="finetune", config=cfg, out_dir=out, mlflow_run_id=active.info.run_id,
                           tracking_uri=uri, inputs={"convert": {"output_dir": local_base},
                                                     "plan": {"plan": {"num_workers": 1}}},
                           store_dir=f"s3://{BUCKET}/work/{run_id}/finetune-1",
                           stored={str(Path(local_base).parent): converted.rsplit("/", 1)[0]})
        record = finetune(ctx)
    tags = MlflowClient(uri).get_model_version(record["registered_model"], record["model_version"]).tags
    assert tags["base_dir"] == converted
