"""calibrate split inside a layer: each layer's routed experts in groups, each group
quantised by its own Ray task and run by its own Ray actor in the compare (the first group
with the rest of the layer); the quantised tensors and the report are the one-process ones."""

from __future__ import annotations

import pytest

from tests.quant_assets import tiny
from tests.test_calibrate_ranges import _close

pytestmark = pytest.mark.usefixtures("one_thread")


def _tensors(folder) -> dict:
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                assert key not in out, f"{key} written twice"
                out[key] = f.get_tensor(key)
    return out


def test_groups_read_only_their_experts_and_fit_a_budget(tmp_path):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.quant.groups import fewest_groups, layer_parts, part_bytes, part_checkpoint_state
    from moeflow.quant.source import ModelSource

    source = ModelSource(tiny("qwen3_moe", num_hidden_layers=3))
    assert layer_parts(source, 1, 3) == [(1, 0, 2, True), (1, 2, 5, False), (1, 5, 8, False)]
    keys = set(part_checkpoint_state(source, (1, 2, 5, False)))
    assert keys == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (2, 3, 4)
                    for p in ("gate", "up", "down")}
    converted = tmp_path / "converted"  # experts stored fused: a part reads its rows only
    convert_checkpoint(source.path, converted, dtype="keep")
    fused = part_checkpoint_state(ModelSource(converted), (1, 2, 5, False))
    assert fused.keys() == keys
    assert all(fused[k].equal(v) for k, v in part_checkpoint_state(source, (1, 2, 5, False)).items())
    whole, half = part_bytes(source, 1), part_bytes(source, 2)
    assert half < whole
    assert fewest_groups(source, whole) == 1 and fewest_groups(source, half) == 2
    assert fewest_groups(source, 1) == 8  # none fits: one expert each


@pytest.mark.slow  # minutes: Ray workers / whole regress runs on 2 cores
def test_groups_give_the_one_process_files_and_report(tmp_path, ray_local, monkeypatch):
    import ray

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

    def spy(*args, **kwargs):  # which functions / classes went to Ray
        wrap = real(*args, **kwargs)
        return lambda fn: remoted.append(fn.__name__) or wrap(fn)
    monkeypatch.setattr(ray, "remote", spy)
    reports, used = {}, {}
    for name, workers, groups in (("one", 1, 1), ("split", 2, 2), ("here", 1, 3)):
        remoted.clear()
        reports[name] = precision_plan(src, tmp_path / name, get_scheme("fp8"), ignore, samples,
                                       min_cosine=0.999, min_top1=0.9, max_steps=0,
                                       layer_workers=workers, expert_groups=groups)
        used[name] = sorted(set(remoted))
    # the range tasks make their group actors themselves; one range (here): this process does
    assert used == {"one": [], "split": ["compare_range", "quantize_units"],
                    "here": ["GroupWorker", "quantize_units"]}
    one, split, here = reports["one"], reports["split"], reports["here"]
    compare = split["result"].pop("memory")
    quantize = split["quantize"].pop("memory")
    one["result"].pop("memory")
    one["quantize"].pop("memory")
    assert [len(m["groups"]) for m in here["result"].pop("memory")[0]["layers"]] == [2]
    here["quantize"].pop("memory")
    _close(one["result"], split["result"])  # the groups' outputs are summed: float rounding apart
    _close(one["result"], here["result"])
    assert one["ignore"] == split["ignore"] and one["steps"] == split["steps"]
    assert len(quantize) == 4 and all(m["peak_bytes"] > 0 for m in quantize)  # 2 ranges x 2 groups
    ranges = compare[0]["layers"]
    assert [m["layers"] for m in ranges] == [[0, 1], [1, 3]]
    assert all(len(m["groups"]) == 1 and m["groups"][0]["peak_bytes"] > 0 for m in ranges)
    assert sorted(p.name for p in (tmp_path / "split").glob("*.safetensors"))[:2] == [
        "model-layer-00000-experts-00000-00004.safetensors", "model-layer-00000-experts-00004-00008.safetensors"]
    a = _tensors(tmp_path / "one")
    for other in ("split", "here"):
        b = _tensors(tmp_path / other)
        assert a.keys() == b.keys()
        for key in a:  # byte-equal quantised tensors
            assert a[key].dtype == b[key].dtype and a[key].view(-1).view(torch_uint8()).equal(
                b[key].view(-1).view(torch_uint8())), key
        assert (tmp_path / "one" / "config.json").read_text() == (tmp_path / other / "config.json").read_text()


def torch_uint8():
    import torch

    return torch.uint8


def test_auto_groups_only_a_layer_larger_than_a_device(tmp_path):
    from moeflow.core.config import validate
    from moeflow.quant.groups import part_bytes
    from moeflow.quant.source import ModelSource
    from tasks.calibrate import expert_groups
    from tests.test_streamed import small_device_spec

    src = str(tiny("qwen3_moe", num_hidden_layers=3))
    from moeflow.core.hardware import GB

    half = part_bytes(ModelSource(src), 2) / GB
    cfg = {"model": {"path": src}}
    assert expert_groups(validate(dict(cfg, hardware="cpu-local")), src) == 1
    small = str(small_device_spec(tmp_path / "small.yaml", half * 1.01))
    assert expert_groups(validate(dict(cfg, hardware=small)), src) == 2
    assert expert_groups(validate(dict(cfg, hardware="cpu-local", calibrate={"expert_groups": 3})), src) == 3
