"""`moeflow watch`: a damaged adapter version (one layer scrambled) gets a FAIL verdict
within a minute of registration, a webhook, and deploy/serve refuse it; an unchanged
re-registration passes against the lineage's last PASS (same model: outputs gated)."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from moeflow.errors import UserError
from moeflow.ops import verdict as V
from moeflow.ops.watch import WatchSettings, watch
from moeflow.serving.fixtures import make_lora_adapter
from tests.conftest import BIN, REPO, cli_env

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]
BASE = REPO / "assets" / "demo-base"
NAME = "demo-adapter"


def _scramble_layer(src: Path, dst: Path, layer: int = 1) -> int:
    """A copy of adapter `src` whose LoRA weights of one decoder layer are scrambled."""
    shutil.copytree(src, dst)
    path = dst / "adapter_model.safetensors"
    state = load_file(str(path))
    gen = torch.Generator().manual_seed(7)
    hit = 0
    for name, t in state.items():
        if f"layers.{layer}." in name:
            state[name] = torch.randn(t.shape, generator=gen) * 2.0
            hit += 1
    save_file(state, str(path))
    return hit


def _register(client, run_exp: str, adapter: Path) -> str:
    run = client.create_run(run_exp)
    client.log_artifacts(run.info.run_id, str(adapter), "adapter")
    client.set_terminated(run.info.run_id)
    mv = client.create_model_version(NAME, source=f"{run.info.artifact_uri}/adapter", run_id=run.info.run_id,
                                     tags={"base_dir": str(BASE)})
    return str(mv.version)


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def _wait_verdict(client, version: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        verdict = client.get_model_version(NAME, version).tags.get(V.VERDICT)
        if verdict:
            return verdict
        time.sleep(0.5)
    raise AssertionError(f"no verdict on version {version} within {timeout} s")


def test_damaged_version_fails_within_a_minute_and_is_refused(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("adapters", artifact_location=str(tmp_path / "artifacts"))
    client.create_registered_model(NAME)
    good = make_lora_adapter(BASE, tmp_path / "good", seed=1, scale=0.01)
    assert _scramble_layer(good, tmp_path / "damaged") >= 2

    hook = http.server.HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    stop, verdicts = threading.Event(), []
    settings = WatchSettings(tracking_uri=uri, models=[NAME], experiment="watch-test",
                             webhook=f"http://127.0.0.1:{hook.server_port}/hook")
    watcher = threading.Thread(target=watch, args=(settings,), daemon=True,
                               kwargs=dict(interval_s=1.0, on_verdict=verdicts.append, stop=stop))
    watcher.start()
    try:
        v1 = _register(client, exp, good)
        assert _wait_verdict(client, v1) == "PASS", verdicts
        t0 = time.monotonic()
        v2 = _register(client, exp, tmp_path / "damaged")
        assert _wait_verdict(client, v2, timeout=60) == "FAIL", verdicts
        elapsed = time.monotonic() - t0
        v3 = _register(client, exp, good)  # unchanged re-registration
        assert _wait_verdict(client, v3) == "PASS", verdicts
        junk = tmp_path / "junk"
        junk.mkdir()
        (junk / "README.md").write_text("not a model")
        v4 = _register(client, exp, junk)
        assert _wait_verdict(client, v4) == "FAIL", verdicts
    finally:
        stop.set()
        watcher.join(timeout=120)
        hook.shutdown()
    print(f"damaged version: FAIL {elapsed:.1f} s after registration")
    assert elapsed < 60
    by_version = {r["version"]: r for r in verdicts}
    assert "base" in by_version[v2]["reference"] and "version 1" in by_version[v2]["reference"]
    assert "FAIL" in by_version[v2]["table"] and by_version[v2]["reason"]
    assert by_version[v3]["reference"] == "base, version 1 (same model)"
    assert "neither a PEFT adapter" in by_version[v4]["reason"]
    # the verdict run holds the table and links back to the version
    run = client.get_run(client.get_model_version(NAME, v2).tags[V.RUN])
    assert run.data.tags["moeflow.model_uri"] == f"models:/{NAME}/{v2}"
    assert [h["version"] for h in _Hook.received] == [v2, v4] and _Hook.received[0]["verdict"] == "FAIL"

    # deploy / serve refuse the FAIL version (one line, exit 2) unless --force
    with pytest.raises(UserError, match=rf"refusing to deploy models:/{NAME}/{v2}: its gate verdict is FAIL"):
        V.require_pass(uri, [(NAME, v2)], force=False)
    forced = []
    V.require_pass(uri, [(NAME, v2)], force=True, notify=forced.append)
    assert "--force" in forced[0]
    V.require_pass(uri, [(NAME, v1), (NAME, v3)], force=False)
    client.set_registered_model_alias(NAME, "champion", v2)  # an alias resolves to the version it names
    with pytest.raises(UserError, match=rf"models:/{NAME}/{v2}: its gate verdict is FAIL"):
        V.require_pass(uri, [(NAME, "@champion")], force=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "model": {"path": str(BASE)}, "tracking": {"uri": uri}}))
    proc = subprocess.run([str(BIN / "moeflow"), "serve", str(cfg), "--adapter", f"x=models:/{NAME}/{v2}"],
                          capture_output=True, text=True, env=cli_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to deploy" in proc.stderr and "Traceback" not in proc.stderr


def test_regress_stage_writes_verdicts_on_the_adapters_it_gated(tmp_path):
    """The pipeline's regress stage tags the registered versions it gated, so `deploy --run`
    of a passing pipeline needs no watcher, and a failed tenant is refused."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from moeflow.evaluation.baseline import Row
    from moeflow.evaluation.gate import Section
    from tasks.regress import _verdicts

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    for name in ("main", "tenant"):
        client.create_registered_model(name)
        client.create_model_version(name, source=str(tmp_path))
    finetune = {"registered_model": "main", "model_version": "1",
                "adapters": {"t": {"registered_model": "tenant", "model_version": "1", "tenant": True}}}
    bad = Row("reverse_nll", "nll", 1.0, 2.0, 0.1, "FAIL", rule="paired")
    sections = [Section("adapter", "base", [Row("reverse_nll", "nll", 1.0, 0.5, 0.1, "better")]),
                Section("adapter 't'", "base", [bad])]
    _verdicts(SimpleNamespace(tracking_uri=uri), finetune, sections)
    assert V.verdict_of(client, "main", "1")[0] == "PASS"
    verdict, reason = V.verdict_of(client, "tenant", "1")
    assert verdict == "FAIL" and "reverse_nll" in reason


def test_deploy_collects_the_registered_versions_it_would_serve():
    from workflows.commands.deploy import _run_versions

    finetune = {"registered_model": "a", "model_version": "3",
                "adapters": {"a": {"registered_model": "a", "model_version": "3"},
                             "t": {"registered_model": "a-t", "model_version": "1"}}}
    got = _run_versions(finetune, {"x": "models:/b/2", "y": "/some/dir", "z": "models:/c@champion"})
    assert got == [("a", "3"), ("a-t", "1"), ("b", "2"), ("c", "@champion")]


def test_deploy_run_refuses_a_failed_version_unless_forced(tmp_path):
    """`moeflow deploy --run RID` of a run whose registered adapter failed its gate: one line,
    nothing deployed; --force goes on (here to the vLLM dry run, which needs no Ray)."""
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from moeflow.config import to_yaml, validate
    from moeflow import tracking as T
    from moeflow.serving.vllm_backend import validate_serve_config
    from tests.test_vllm_backend import _plan
    from workflows.commands.deploy import register

    import typer

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    client.create_registered_model(NAME)
    client.create_model_version(NAME, source=str(tmp_path))
    V.set_verdict(client, NAME, "1", False, None, "candidate vs base: reverse_nll/nll 1.1 -> 4.2", "base")
    parent = client.create_run(exp, tags={T.KIND: "pipeline"}).info.run_id
    client.log_text(parent, to_yaml(validate({"model": {"path": str(BASE)}, "tracking": {"uri": uri}})),
                    "config.yaml")
    adapter = make_lora_adapter(BASE, tmp_path / "adapter", seed=1)
    records = {"convert": {"output_dir": str(BASE)}, "plan": _plan(tmp_path, BASE),
               "finetune": {"adapter_dir": str(adapter), "adapter_name": "a", "registered_model": NAME,
                            "model_version": "1"}}
    for stage, record in records.items():
        out = tmp_path / f"rec-{stage}"
        out.mkdir()
        (out / "result.json").write_text(json.dumps(record))
        child = client.create_run(exp, tags={T.PARENT: parent, T.STAGE: stage, T.OUT_DIR: str(out)}).info.run_id
        client.set_tag(parent, T.STAGE_RUN_PREFIX + stage, child)
        client.set_tag(parent, T.STATE_PREFIX + stage, "done")
    app = typer.Typer()
    register(app)
    args = ["deploy", "--run", parent, "--tracking-uri", uri, "--backend", "vllm", "--dry-run",
            "--out", str(tmp_path / "serve.yaml"), "--lora-uri", "s3://moeflow-test/adapters"]
    res = CliRunner().invoke(app, args)
    assert isinstance(res.exception, UserError)
    assert str(res.exception) == (f"refusing to deploy models:/{NAME}/1: its gate verdict is FAIL "
                                  f"(candidate vs base: reverse_nll/nll 1.1 -> 4.2); --force deploys it anyway")
    res = CliRunner().invoke(app, args + ["--force"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert "a: served as" in res.output  # on to the vLLM dry run: the Serve config of the forced run
    (served,) = validate_serve_config(yaml.safe_load((tmp_path / "serve.yaml").read_text()))
    assert served.engine_kwargs["enable_lora"]
    assert "deploying models:/demo-adapter/1 although its gate verdict is FAIL" in res.output
