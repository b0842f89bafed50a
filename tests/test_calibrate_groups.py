"""calibrate split inside a layer: each layer's routed experts in groups, each group
quantised by its own Ray task and run by its own Ray actor in the compare (the first group
with the rest of the layer); the quantised tensors and the report are the one-process ones,
and a group's process holds no more than the planner sizes it by."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.quant_assets import tiny

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


def _tensors(folder) -> dict:
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                assert key not in out, f"{key} written twice"
                out[key] = f.get_tensor(key)
    return out


def test_groups_read_only_their_experts_and_assemble_them_as_the_whole_layer(tmp_path):
    import torch

    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.quant.groups import expert_runtime_state, layer_parts, part_checkpoint_state
    from moeflow.quant.source import ModelSource

    source = ModelSource(tiny("qwen3_moe", num_hidden_layers=3))
    assert layer_parts(source, 1, 3) == [(1, 0, 2, True), (1, 2, 5, False), (1, 5, 8, False)]
    keys = set(part_checkpoint_state(source, (1, 2, 5, False)))
    assert keys == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (2, 3, 4)
                    for p in ("gate", "up", "down")}
    converted = tmp_path / "converted"  # experts stored fused: a part reads its rows only
    convert_checkpoint(source.path, converted, dtype="keep")
    fused = ModelSource(converted)
    assert part_checkpoint_state(fused, (1, 2, 5, False)).keys() == keys
    assert all(part_checkpoint_state(fused, (1, 2, 5, False))[k].equal(v)
               for k, v in part_checkpoint_state(source, (1, 2, 5, False)).items())
    # assembled expert by expert: the whole layer's runtime tensors, rows [a, b), in the dtype asked
    for src in (source, fused):  # per-expert tensors through the converter; fused rows
        whole = src.layer_state(1)
        for dtype in (None, torch.float32):
            part = expert_runtime_state(src, 1, 2, 5, dtype)
            assert part.keys() == {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
            for name, value in part.items():
                want = whole[name][2:5]
                assert value.dtype == (dtype or want.dtype) and value.equal(want.to(value.dtype)), name


def test_auto_groups_are_the_planners(tmp_path):
    """tasks/calibrate.py resolves `auto` with the planner's own sizing (footprint.calibrate_layout):
    one group where a layer's worker fits a device, the planner's count where it does not."""
    from moeflow.core.config import validate
    from moeflow.core.hardware import GB, load_hardware
    from moeflow.model.params import count_params, spec_from_path
    from moeflow.parallel.footprint import calibrate_layout
    from tasks.calibrate import expert_groups
    from tests.test_streamed import small_device_spec

    src = str(tiny("qwen3_moe", num_hidden_layers=3))
    spec = spec_from_path(src)
    cfg = {"model": {"path": src}, "calibrate": {"samples": 4, "max_tokens": 32}}
    assert expert_groups(validate(dict(cfg, hardware="cpu-local")), src) == 1
    hw = load_hardware("cpu-local")
    two = calibrate_layout(spec, count_params(spec), hw, 1, 2, 2.0, 4 * 32).worker_bytes  # bf16 stored
    small = str(small_device_spec(tmp_path / "small.yaml", two * 1.001 / GB + hw.runtime_overhead_gb))
    assert expert_groups(validate(dict(cfg, hardware=small)), src) == 2
    assert calibrate_layout(spec, count_params(spec), load_hardware(small), 1, "auto", 2.0, 4 * 32).expert_groups == 2
    assert expert_groups(validate(dict(cfg, hardware="cpu-local", calibrate={"expert_groups": 3})), src) == 3


# a layer whose expert group is tens of MB: the group's own bytes, not the process's, dominate
WIDE = dict(hidden_size=512, moe_intermediate_size=768, num_experts=32, num_experts_per_tok=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1024)

_WORKER = """
import json, sys, torch
torch.set_num_threads(1)
from moeflow.quant.groups import GroupWorker
base, cand, a, b, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
worker = GroupWorker("cpu")  # the class the compare's Ray actors run
gen = torch.Generator().manual_seed(0)
hidden = torch.randn(tokens, 512, generator=gen)
index = torch.randint(0, 32, (tokens, 2), generator=gen)
weights = torch.rand(tokens, 2, generator=gen)
for path in (base, cand, base, cand):  # a layer of each side, twice: as a range's layers load them
    worker.load(path, (0, a, b, False))
    worker.run(hidden, index, weights)
print(json.dumps(worker.memory()))
"""


@pytest.mark.slow  # ~1 min: a 75 MB checkpoint written, converted and quantised
def test_a_group_worker_holds_no_more_than_the_planner_sizes_it_by(tmp_path):
    """A group's process reads, assembles and runs its experts of the baseline and of the
    quantised candidate within what the planner books for it (moeflow.parallel.footprint)."""
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.core.hardware import load_hardware
    from moeflow.model.params import count_params, spec_from_path
    from moeflow.parallel.footprint import calibrate_layout
    from moeflow.quant.quantize import default_ignore, quantize_checkpoint
    from moeflow.quant.schemes import get_scheme
    from moeflow.quant.source import ModelSource

    src = tiny("qwen3_moe", num_hidden_layers=1, **WIDE)
    base, cand = tmp_path / "base", tmp_path / "fp8"
    convert_checkpoint(src, base, dtype="keep")  # fused experts, bf16: read by rows
    quantize_checkpoint(base, cand, get_scheme("fp8"), default_ignore(ModelSource(base)))  # per expert
    tokens = 48
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(base), str(cand), "16", "32", str(tokens)],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = json.loads(proc.stdout.splitlines()[-1])["peak_bytes"]
    spec = spec_from_path(base)
    booked = calibrate_layout(spec, count_params(spec), load_hardware("cpu-local"), 1, 2, 2.0, tokens).worker_bytes
    part = 16 * 3 * 512 * 768 * 4  # the group's experts in float32
    assert part < peak <= booked, (peak, booked)


@pytest.mark.slow  # minutes: Ray workers on 2 cores
def test_groups_give_the_one_process_files_and_report(tmp_path, ray_local, monkeypatch):
    """4 layers: split by ranges and groups, or by groups alone, the quantised tensors are
    byte-equal and the compare's report is equal -- exactly: top-2 routing, so a token's two
    expert outputs meet in one addition wherever they run (moeflow/quant/groups.py)."""
    import ray
    import torch

    from moeflow.evaluation.suite import load_suite
    from moeflow.quant.golden import golden_samples
    from moeflow.quant.plan import precision_plan
    from moeflow.quant.quantize import default_ignore
    from moeflow.quant.schemes import get_scheme
    from moeflow.quant.source import ModelSource

    src = tiny("qwen3_moe", num_hidden_layers=4)
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
    assert [len(m["groups"]) for m in here["result"].pop("memory")[0]["layers"]] == [2]
    for r in (one, here):
        r["result"].pop("memory", None)
        r["quantize"].pop("memory")
    for r in (split, here):
        assert r["result"] == one["result"]  # the report, every number bit for bit
        assert (r["ignore"], r["steps"], r["added"], r["holds"]) == (one["ignore"], one["steps"], one["added"],
                                                                   one["holds"])
        # the quantiser's record: the same modules; its files are one per group by design
        layout = ("files", "bytes", "seconds", "output_dir")
        assert {k: v for k, v in r["quantize"].items() if k not in layout} == \
            {k: v for k, v in one["quantize"].items() if k not in layout}
    assert len(quantize) == 4 and all(m["peak_bytes"] > 0 for m in quantize)  # 2 ranges x 2 groups
    ranges = compare[0]["layers"]
    assert [m["layers"] for m in ranges] == [[0, 2], [2, 4]]
    assert all(len(m["groups"]) == 1 and m["groups"][0]["peak_bytes"] > 0 for m in ranges)
    assert sorted(p.name for p in (tmp_path / "split").glob("*.safetensors"))[:2] == [
        "model-layer-00000-experts-00000-00004.safetensors", "model-layer-00000-experts-00004-00008.safetensors"]
    a = _tensors(tmp_path / "one")
    for other in ("split", "here"):
        b = _tensors(tmp_path / other)
        assert a.keys() == b.keys()
        for key in a:  # byte-equal quantised tensors
            assert a[key].dtype == b[key].dtype and a[key].view(-1).view(torch.uint8).equal(
                b[key].view(-1).view(torch.uint8)), key
        assert (tmp_path / "one" / "config.json").read_text() == (tmp_path / other / "config.json").read_text()
