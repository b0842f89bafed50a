"""regress layer-streamed (regress.streamed): base and adapters evaluated one decoder layer
at a time give the in-memory evaluation's verdict and metrics, and nothing loads the whole model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from moeflow.core.errors import UserError
from tests.eval_assets import assets
from tests.test_regress_stage import _ctx, _in_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def uri(mlflow_uri):
    return mlflow_uri


def _stage(tmp_path: Path, uri: str, adapter: str, streamed: str, monkeypatch):
    from moeflow.evaluation import runners

    used = []
    for name in ("HFRunner", "StreamedRunner"):
        module = runners if name == "HFRunner" else __import__("moeflow.evaluation.streamed_runner",
                                                              fromlist=[name])
        cls = getattr(module, name)
        init = cls.__init__

        def spy(self, *args, _init=init, _name=name, **kwargs):
            if type(self).__name__ == _name:
                used.append(_name)
            _init(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", spy)
    if streamed == "always":  # nothing may load the whole model: not the probe, not an engine check
        def whole(*_a, **_k):
            raise AssertionError("the whole model was loaded")
        for target in ("moeflow.model.models.load_model", "moeflow.evaluation.probe.load_model",
                       "moeflow.evaluation.runners.load_model"):
            monkeypatch.setattr(target, whole)
    out = tmp_path / streamed
    out.mkdir()
    result, _ = _in_run(uri, _ctx(out, uri, adapter, streamed=streamed))
    monkeypatch.undo()
    return result, set(used)


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-5), (key, a[key], b[key])


@pytest.mark.slow  # minutes: Ray workers / whole regress runs on 2 cores
def test_streamed_regress_gives_the_in_memory_verdict_and_metrics(tmp_path, uri, monkeypatch):
    never, used = _stage(tmp_path, uri, "good", "never", monkeypatch)
    assert used == {"HFRunner"} and isinstance(never, dict), never
    always, used = _stage(tmp_path, uri, "good", "always", monkeypatch)
    assert used == {"StreamedRunner"} and isinstance(always, dict), always
    assert never["passed"] is always["passed"] is True
    assert always["streamed"] is True and never["streamed"] is False
    assert always["probe"] is None and always["loadable"]["not_checked"]
    _close(never["metrics"], always["metrics"])  # log-likelihood, generation and choice tasks
    _close(never["base_metrics"], always["base_metrics"])
    assert any("reverse_em" in k for k in always["metrics"])  # a generation task was scored


@pytest.mark.slow  # minutes: Ray workers / whole regress runs on 2 cores
def test_streamed_regress_fails_a_damaging_adapter_as_in_memory(tmp_path, uri, monkeypatch):
    never, _ = _stage(tmp_path, uri, "random", "never", monkeypatch)
    always, used = _stage(tmp_path, uri, "random", "always", monkeypatch)
    assert used == {"StreamedRunner"}
    assert isinstance(never, UserError) and isinstance(always, UserError)
    assert "regressed vs base: reverse_nll/bits_per_byte" in str(always)
    assert str(never).split(" (table:")[0] == str(always).split(" (table:")[0]


def test_auto_streams_only_a_model_larger_than_a_device(tmp_path):
    from moeflow.core.config import validate
    from tasks.base import streams_layers
    from tests.test_streamed import small_device_spec

    base = str(assets()["base"])
    small = str(small_device_spec(tmp_path / "small.yaml", 1e-4))
    cfg = {"model": {"path": base}}
    assert not streams_layers(validate(dict(cfg, hardware="cpu-local")), "auto", base, "float32")
    assert streams_layers(validate(dict(cfg, hardware=small)), "auto", base, "float32")
