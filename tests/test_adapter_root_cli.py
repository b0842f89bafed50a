"""`deploy --run` / `serve` take `--adapter-root DIR`: runtime load_lora_adapter of a local
directory then works under it (the run's config usually has no deploy.adapter_root)."""

import pytest
import yaml

from moeflow.core.errors import UserError


def test_adapter_root_reaches_the_served_config(tmp_path, monkeypatch):
    from workflows.commands import deploy

    seen = {}
    monkeypatch.setattr(deploy, "_run_deploy", lambda cfg, *a, **k: seen.setdefault("cfg", cfg))
    monkeypatch.setattr(deploy, "_refuse_too_large", lambda cfg: None)  # "m" has no config.json
    (tmp_path / "m").mkdir()
    (tmp_path / "adapters").mkdir()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "model": {"path": str(tmp_path / "m")}}))
    monkeypatch.chdir(tmp_path)
    deploy.serve_cmd(str(config), adapter=[], merge=None, port=None, api_key=None, set_=[], ingress=None,
                     adapter_root="adapters")
    assert seen["cfg"].deploy.adapter_root == str((tmp_path / "adapters").resolve())  # absolute: replicas
    with pytest.raises(UserError, match="--adapter-root nope: not a directory"):
        deploy.serve_cmd(str(config), adapter=[], merge=None, port=None, api_key=None, set_=[], ingress=None,
                         adapter_root="nope")


@pytest.mark.parametrize("compile_", [True, False])
def test_a_compiled_deployment_says_why_its_start_takes_minutes(tmp_path, monkeypatch, capsys, compile_):
    import contextlib

    from moeflow.core.config import validate
    from moeflow.serving import launch, preflight
    from workflows import raylocal
    from workflows.commands import deploy

    record = {"url": "http://127.0.0.1:1", "mode": "shared", "smoke": {"models": [], "completions": {}}}
    monkeypatch.setattr(preflight, "check_deployment", lambda *a: None)
    monkeypatch.setattr(raylocal, "ray_session", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(raylocal, "ray_address", lambda *a: "cluster:6379")  # returns once deployed
    monkeypatch.setattr(launch, "apply_plan", lambda cfg, serving: cfg)
    monkeypatch.setattr(launch, "settings_for", lambda *a, **k: None)
    monkeypatch.setattr(launch, "deploy", lambda *a: record)
    cfg = validate({"name": "t", "model": {"path": str(tmp_path)}, "deploy": {"compile": compile_}})
    deploy._run_deploy(cfg, None, "key", "cluster:6379")
    assert ("compiles its forwards" in capsys.readouterr().out) == compile_
