"""calibrate split over Ray workers by contiguous ranges of decoder layers: each worker
reads only its layers (quantisation) or gets the recorded inputs of its first layer
(compare); the files and the report are the one-process ones."""

from __future__ import annotations

import math

import pytest

from moeflow.quant.streamed import layer_ranges
from tests.quant_assets import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_layer_ranges_cover_every_layer_once():
    assert layer_ranges(5, 2) == [(0, 2), (2, 5)]
    assert layer_ranges(2, 8) == [(0, 1), (1, 2)]
    assert layer_ranges(7, 1) == [(0, 7)]
    for layers, workers in ((93, 16), (4, 3)):
        spans = layer_ranges(layers, workers)
        assert [i for a, b in spans for i in range(a, b)] == list(range(layers))


def _close(a, b, path="report"):
    """Same structure and strings; numbers within float noise (threads differ per process)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), path
    else:
        assert a == b, path


def test_ranges_give_the_one_process_files_and_report(tmp_path, ray_local, monkeypatch):
    import ray
    from safetensors import safe_open

    from moeflow.evaluation.suite import load_suite
    from moeflow.quant.golden import golden_samples
    from moeflow.quant.plan import precision_plan
    from moeflow.quant.quantize import default_ignore
    from moeflow.quant.schemes import get_scheme
    from moeflow.quant.source import ModelSource

    src = tiny("qwen3_moe", num_hidden_layers=3)
    samples = golden_samples(load_suite(None), src, limit=3)
    ignore = default_ignore(ModelSource(src))
    remoted: list[str] = []
    real = ray.remote

    def spy(*args, **kwargs):  # which functions went to Ray tasks
        wrap = real(*args, **kwargs)
        return lambda fn: remoted.append(fn.__name__) or wrap(fn)
    monkeypatch.setattr(ray, "remote", spy)
    reports = {}
    for workers in (1, 2):
        reports[workers] = precision_plan(src, tmp_path / f"q{workers}", get_scheme("fp8"), ignore, samples,
                                          min_cosine=0.999, min_top1=0.9, max_steps=0,
                                          layer_workers=workers)
    assert sorted(set(remoted)) == ["compare_range", "quantize_units"]  # only with 2 workers
    one, split = reports[1], reports[2]
    memory = {n: (r["result"].pop("memory"), r["first"].pop("memory", None), r["quantize"].pop("memory"))
              for n, r in reports.items()}  # first is result here (no plan round)
    _close(one["result"], split["result"])
    _close(one["first"], split["first"])
    compare, _, quantize = memory[2]  # each range measured where it ran
    assert [m["layers"] for m in compare[0]["layers"]] == [[0, 1], [1, 3]]
    assert len(quantize) == 2 and all(m["peak_bytes"] > 0 for m in quantize + compare[0]["layers"])
    assert one["ignore"] == split["ignore"] and one["steps"] == split["steps"]
    files = sorted(p.name for p in (tmp_path / "q1").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "q2").glob("*.safetensors")) and len(files) == 4
    for name in files:  # the quantised tensors themselves are equal
        with safe_open(str(tmp_path / "q1" / name), "pt") as a, safe_open(str(tmp_path / "q2" / name), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for key in a.keys():
                assert a.get_tensor(key).equal(b.get_tensor(key)), f"{name}: {key}"
    assert (tmp_path / "q1" / "config.json").read_text() == (tmp_path / "q2" / "config.json").read_text()


def test_auto_splits_only_a_model_larger_than_a_device(tmp_path):
    from moeflow.core.config import validate
    from tasks.calibrate import layer_workers
    from tests.test_streamed import small_device_spec

    src = str(tiny("qwen3_moe", num_hidden_layers=3))
    small = str(small_device_spec(tmp_path / "small.yaml", 1e-4))  # 2 devices per node
    cfg = {"model": {"path": src}}
    assert layer_workers(validate(dict(cfg, hardware="cpu-local")), src) == 1
    assert layer_workers(validate(dict(cfg, hardware=small)), src) == 2
    assert layer_workers(validate(dict(cfg, hardware="cpu-local", calibrate={"layer_workers": 3})), src) == 3
