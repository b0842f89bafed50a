"""`moeflow watch`: a damaged adapter version (one layer scrambled) gets a FAIL verdict
within a minute of registration, a webhook, and deploy/serve refuse it; an unchanged
re-registration passes against the lineage's last PASS (same model: outputs gated)."""

from __future__ import annotations

import http.server
import io
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

from moeflow.core.errors import UserError
from moeflow.evaluation import verdict as V
from moeflow.ops.watch import WatchSettings, watch
from moeflow_testing.serving import make_lora_adapter
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
    import typer
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from moeflow.core import tracking as T
    from moeflow.core.config import to_yaml, validate
    from moeflow.serving.vllm_backend import validate_serve_config
    from tests.test_vllm_backend import _plan
    from workflows.commands.deploy import register

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


def _suite(root: Path, prompts: list[str], targets: list[str], name: str) -> Path:
    """A one-task suite: greedy answers to `prompts` must equal `targets` exactly."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "echo.jsonl").write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n"
                                             for p, t in zip(prompts, targets)))
    (root / "suite.yaml").write_text(yaml.safe_dump({
        "name": name, "version": 1, "target_tasks": ["echo"],
        "tasks": [{"name": "echo", "type": "generation", "file": "echo.jsonl", "match": "exact",
                   "max_new_tokens": 4, "stop": ["\n"], "abs_tol": 0.05}]}))
    return root / "suite.yaml"


def _strong_and_weak(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(suite, strong adapter, weakened copy): the suite's answers are the strong adapter's own
    greedy outputs (it scores 1.0); the weakened copy (LoRA B x 0) answers as the base does."""
    from moeflow.evaluation.runners import evaluate
    from moeflow.evaluation.suite import load_suite

    strong = make_lora_adapter(BASE, tmp_path / "strong", seed=3, scale=0.5)
    prompts = [f"reverse: {w}\nanswer:" for w in ("kqzm", "ftb", "oipd", "jqj", "mwe", "zal", "hrud", "pic")]
    probe = load_suite(_suite(tmp_path / "probe", prompts, ["-"] * len(prompts), "probe"))
    base, adapted = evaluate(probe, BASE, [None, str(strong)])
    outputs = [s["output"] for s in adapted["tasks"]["echo"]["samples"]]
    differ = sum(a != s["output"] for a, s in zip(outputs, base["tasks"]["echo"]["samples"]))
    assert differ >= 4, "the strong adapter must answer differently from the base"
    weak = tmp_path / "weak"
    shutil.copytree(strong, weak)
    state = load_file(str(weak / "adapter_model.safetensors"))
    save_file({k: t * 0 if "lora_B" in k else t for k, t in state.items()},
              str(weak / "adapter_model.safetensors"))
    return _suite(tmp_path / "gate", prompts, outputs, "gate"), strong, weak


def test_watch_fails_a_weakened_tenant_against_a_regress_written_pass(tmp_path):
    """The regress stage gates tenant version 1 (PASS) and records its outputs; version 2, a
    weakened retrain, does not regress vs the base but does vs version 1: the watcher FAILs it,
    naming both references. An unchanged re-registration passes as the same model."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from moeflow.core.config import validate
    from tasks.base import StageContext
    from tasks.regress import run as regress

    suite, strong, weak = _strong_and_weak(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("adapters", artifact_location=str(tmp_path / "artifacts"))
    for name in ("gate-main", "gate-t"):
        client.create_registered_model(name)
    main, tenant = _register_as(client, exp, "gate-main", strong), _register_as(client, exp, "gate-t", strong)
    cfg = validate({"name": "gate", "model": {"path": str(BASE)}, "tracking": {"uri": uri},
                    "regress": {"suite": str(suite), "shards": 1}})
    finetune = {"adapter_dir": str(strong), "adapter_name": "main", "registered_model": "gate-main",
                "model_version": main, "adapters": {"t": {
                    "adapter_dir": str(strong), "registered_model": "gate-t", "model_version": tenant,
                    "target_tasks": ["echo"], "tenant": True}}}
    out = tmp_path / "regress"
    out.mkdir()
    ctx = StageContext(stage="regress", config=cfg, out_dir=out, tracking_uri=uri,
                       inputs={"convert": {"output_dir": str(BASE)}, "finetune": finetune})
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as stage_run:
        regress(ctx)
    tags = client.get_model_version("gate-t", tenant).tags
    assert tags[V.VERDICT] == "PASS" and tags[V.RUN] == stage_run.info.run_id

    v2 = _register_as(client, exp, "gate-t", weak)
    v3 = _register_as(client, exp, "gate-t", strong)  # unchanged: the same model as version 1
    settings = WatchSettings(tracking_uri=uri, models=["gate-t"], suite=str(suite), experiment="watch-test")
    verdicts = {r["version"]: r for r in watch(settings, once=True)}
    assert verdicts[v2]["verdict"] == "FAIL", verdicts[v2]
    assert verdicts[v2]["reference"] == f"base, version {tenant} (changed)"
    assert verdicts[v2]["failures"] == [f"candidate vs version {tenant} (changed): echo/exact_match 1 -> 0"
                                        f"{verdicts[v2]['failures'][0].split('-> 0', 1)[1]}"]
    assert "candidate vs base" not in verdicts[v2]["reason"]  # it did not regress vs its base
    assert verdicts[v3]["verdict"] == "PASS" and verdicts[v3]["reference"] == f"base, version {tenant} (same model)"
    # a last PASS whose recorded outputs are gone (an older verdict): evaluated again, still gated
    client.set_model_version_tag("gate-t", v3, V.RESULTS, "verdict/gone.json")
    v4 = _register_as(client, exp, "gate-t", weak)
    (again,) = watch(settings, once=True)
    assert again["version"] == v4 and again["verdict"] == "FAIL", again
    assert again["reference"] == f"base, version {v3} (changed)"
    # on an 80-column terminal the verdict fits its lines (the whole table is in the run)
    from rich.console import Console

    from workflows.actions.watch import show as _show

    term = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    _show(term, verdicts[v2])
    shown = term.export_text().splitlines()
    assert max(map(len, shown)) <= 80 and "FAIL" in shown[0] and "echo/exact_match" in "".join(shown)


def test_a_version_without_base_dir_is_gated_again_once_tagged(tmp_path):
    """No base_dir tag: a one-line FAIL saying how to fix it; the watcher leaves it alone until
    the tag is set, then gates it again by itself. `watch --regate` gates any version again."""
    import typer
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from workflows.commands.watch import register

    app = typer.Typer()
    register(app)
    app.command("unused")(lambda: None)  # two commands: the first argument names one
    prompts = [f"reverse: {w}\nanswer:" for w in ("kqzm", "ftb", "oipd")]
    suite = _suite(tmp_path / "suite", prompts, ["-"] * 3, "tiny")
    adapter = make_lora_adapter(BASE, tmp_path / "a", seed=1, scale=0.01)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("adapters", artifact_location=str(tmp_path / "artifacts"))
    client.create_registered_model(NAME)
    v1 = _register_as(client, exp, NAME, adapter, base_dir=None)  # registered the usual MLflow way
    settings = WatchSettings(tracking_uri=uri, models=[NAME], suite=str(suite), experiment="watch-test")
    (first,) = watch(settings, once=True)
    assert first["verdict"] == "FAIL" and first["reason"].startswith("no base_dir tag")
    assert "set the version's base_dir tag" in first["reason"] and "\n" not in first["reason"]
    assert watch(settings, once=True) == []  # nothing changed: not gated again
    client.set_model_version_tag(NAME, v1, "base_dir", str(BASE))
    (again,) = watch(settings, once=True)
    assert again["verdict"] == "PASS" and again["reference"] == "base, no earlier PASS (first of its lineage)"
    assert V.WANTS not in client.get_model_version(NAME, v1).tags
    res = CliRunner().invoke(app, ["watch", "--regate", f"models:/{NAME}/{v1}", "--once", "--model", NAME,
                                   "--suite", str(suite), "--tracking-uri", uri, "--experiment", "watch-test"])
    assert res.exit_code == 0, res.output
    assert f"models:/{NAME}/{v1}: verdict PASS cleared" in res.output and f"models:/{NAME}/{v1}: PASS" in res.output
    res = CliRunner().invoke(app, ["watch", "--regate", f"runs:/{NAME}", "--tracking-uri", uri])
    assert isinstance(res.exception, UserError)
    assert str(res.exception).startswith("--regate 'runs:/demo-adapter': expected models:/NAME/VERSION")


def _register_as(client, exp: str, name: str, adapter: Path, base_dir: str | None = str(BASE)) -> str:
    run = client.create_run(exp)
    client.log_artifacts(run.info.run_id, str(adapter), "adapter")
    client.set_terminated(run.info.run_id)
    tags = {"base_dir": base_dir} if base_dir else {}
    return str(client.create_model_version(name, source=f"{run.info.artifact_uri}/adapter",
                                           run_id=run.info.run_id, tags=tags).version)
