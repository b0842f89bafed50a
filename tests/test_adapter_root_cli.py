"""`deploy --run` / `serve` take `--adapter-root DIR`: runtime load_lora_adapter of a local
directory then works under it (the run's config usually has no deploy.adapter_root)."""

import pytest
import yaml

from moeflow.errors import UserError


def test_adapter_root_reaches_the_served_config(tmp_path, monkeypatch):
    from workflows.commands import deploy

    seen = {}
    monkeypatch.setattr(deploy, "_run_deploy", lambda cfg, *a, **k: seen.setdefault("cfg", cfg))
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
