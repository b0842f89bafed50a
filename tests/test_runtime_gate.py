"""One gate for every way an adapter reaches a server: a running server's
`POST /v1/load_lora_adapter` of a registered version applies the verdict rule `moeflow serve
--adapter` applies (FAIL: 403, no verdict yet: 409, naming it), unless the server was started
with --force (then it loads, and says so in its log)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from moeflow.evaluation import verdict as V
from moeflow.serving.api import create_app
from moeflow.serving.service import ServeSettings, Service
from moeflow_testing.serving import make_lora_adapter
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = REPO / "assets" / "demo-base"
NAME = "gated"


def _registry(tmp_path: Path) -> str:
    """Versions 1 (PASS), 2 (FAIL), 3 (no verdict yet) of one adapter, alias `champion` on 2."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("a", artifact_location=str(tmp_path / "artifacts"))
    client.create_registered_model(NAME)
    adapter = make_lora_adapter(BASE, tmp_path / "adapter", seed=1)
    for _ in range(3):
        run = client.create_run(exp).info.run_id
        client.log_artifacts(run, str(adapter), "adapter")
        client.create_model_version(NAME, source=f"runs:/{run}/adapter", run_id=run)
    V.set_verdict(client, NAME, "1", True, None, "no regression vs base", "base")
    V.set_verdict(client, NAME, "2", False, None, "candidate vs base: reverse_nll/nll 1.1 -> 4.2", "base")
    client.set_registered_model_alias(NAME, "champion", "2")
    return uri


def _load(http: TestClient, name: str, path: str):
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_runtime_load_applies_the_gate_verdict(tmp_path, caplog):
    uri = _registry(tmp_path)
    service = Service(ServeSettings(base_dir=str(BASE), tracking_uri=uri, download_dir=str(tmp_path / "dl")))
    try:
        http = TestClient(create_app(service))
        bad = _load(http, "t10", f"models:/{NAME}/2")
        assert bad.status_code == 403, bad.text
        err = bad.json()["error"]
        assert err["param"] == "lora_path" and err["message"] == (
            f"lora_path models:/{NAME}/2: refusing models:/{NAME}/2: its gate verdict is FAIL (candidate vs "
            "base: reverse_nll/nll 1.1 -> 4.2); a server started with --force loads it")
        alias = _load(http, "t11", f"models:/{NAME}@champion")  # an alias: the version it names now
        assert alias.status_code == 403 and f"refusing models:/{NAME}/2" in alias.json()["error"]["message"]
        pending = _load(http, "t12", f"models:/{NAME}/3")
        assert pending.status_code == 409 and "no gate verdict yet" in pending.json()["error"]["message"]
        missing = _load(http, "t13", f"models:/{NAME}/9")
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["demo-base"]  # none loaded
        ok = _load(http, "good", f"models:/{NAME}/1")
        assert ok.status_code == 200, ok.text
        out = http.post("/v1/completions", json={"model": "good", "prompt": "reverse: ab\nanswer:",
                                                 "max_tokens": 3, "temperature": 0})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1

        # a server started with --force loads it, and its log says so
        service.settings = service.settings.model_copy(update={"allow_ungated": True})
        with caplog.at_level(logging.WARNING, logger="moeflow.serving"):
            forced = _load(http, "t10", f"models:/{NAME}/2")
        assert forced.status_code == 200, forced.text
        assert f"loading models:/{NAME}/2 at run time although its gate verdict is FAIL" in caplog.text
    finally:
        service.close()
