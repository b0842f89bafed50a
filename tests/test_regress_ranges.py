"""regress over resident layer ranges (regress.layout ranges, moeflow.evaluation.ranges_runner):
Ray actors each holding a contiguous range of decoder layers give the layer-streamed runner's
log-likelihoods and greedy generations for the base and every adapter, read each layer once;
the layout is resolved as the dry run prices it, and the reference's regress takes minutes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from moeflow.core.config import load_config, validate
from moeflow.core.errors import UserError
from tests.eval_assets import assets

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "configs" / "reference-2.8t.yaml"
PAIRS = [("Reverse the word: cat ->", " tac"), ("The capital of France is", " Paris"), ("", "plain text")]
PROMPTS = ["Reverse the word: dog ->", "one two three"]


def _outputs(runner, adapters: list[str]) -> list:
    """Base, then each adapter as attached (the newest in force), then the base again."""
    out = []
    with runner.base_only():
        out.append((runner.loglikelihood_detail(PAIRS), runner.generate_detail(PROMPTS, 4)))
    for adapter in adapters:
        runner.attach_adapter(adapter)
        out.append((runner.loglikelihood_detail(PAIRS), runner.generate_detail(PROMPTS, 4)))
    with runner.base_only():
        out.append((runner.loglikelihood_detail(PAIRS), runner.generate_detail(PROMPTS, 4)))
    return out


def _same(a, b) -> None:
    for (ll_a, gen_a), (ll_b, gen_b) in zip(a, b, strict=True):
        for x, y in zip(ll_a, ll_b, strict=True):
            assert x["top_ids"] == y["top_ids"]
            assert math.isclose(x["loglik"], y["loglik"], rel_tol=1e-5, abs_tol=1e-5), (x["loglik"], y["loglik"])
        for x, y in zip(gen_a, gen_b, strict=True):
            assert x["step_ids"] == y["step_ids"] and x["output"] == y["output"]


def test_a_range_runs_its_layers_with_the_adapter_in_force():
    """The actor's class in this process (no Ray): two ranges of one layer each, chained as the
    runner chains them, give the streamed forward's hidden states for the base and for each
    adapter as it is attached (the newest in force), and a range switched back to the base
    drops the adapters."""
    import torch

    from moeflow.evaluation.ranges_runner import LayerRange
    from moeflow.evaluation.streamed_runner import StreamedRunner

    a = assets()
    ref = StreamedRunner(a["base"], batch_size=2)
    ranges = [LayerRange(str(a["base"]), 0, 1, "float32"), LayerRange(str(a["base"]), 1, 2, "float32")]
    enc = ref.tokenizer([p + c for p, c in PAIRS[:2]], return_tensors="pt", padding=True)
    inputs = [{"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}]

    def chained(active):
        run = ref.streamed.front.run(inputs[0])
        hidden, context = run["hidden"], {"calls": run["calls"], "deltas": run["deltas"]}
        for r in ranges:
            hidden = r.forward(hidden, context, active)
        return hidden

    def check(active):
        want = ref._hidden_states(inputs)[0]
        torch.testing.assert_close(chained(active), want, rtol=1e-5, atol=1e-5)
        return want

    with ref.base_only():
        base = check(None)
    seen = [base]
    for adapter in (a["good"], a["random"]):
        ref.attach_adapter(adapter)
        name = ref.adapters[-1]
        config, state = ref._loaded[name]
        for r in ranges:
            assert r.attach(name, config, state) == [r.start]  # its own layer only
        seen.append(check(name))
    with ref.base_only():
        check(None)
    assert not torch.allclose(seen[0], seen[1]) and not torch.allclose(seen[1], seen[2])  # each adapter acts
    assert [r.record()["built"] for r in ranges] == [{0: 1}, {1: 1}]


@pytest.mark.slow  # ~1 min on the shared 2-core host: Ray, two actor processes, both runners
def test_ranges_give_the_streamed_outputs_and_read_each_layer_once(ray_local):
    """Two ranges (one actor per layer of the 2-layer model), two adapters attached in turn (the
    damaging one also on lm_head, in the front): every output equals the layer-streamed runner's;
    each range read its layer once and holds the adapters' tensors of its layers only."""
    from moeflow.evaluation.ranges_runner import RangesRunner
    from moeflow.evaluation.streamed_runner import StreamedRunner

    a = assets()
    adapters = [str(a["good"]), str(a["random"])]
    want = _outputs(StreamedRunner(a["base"], batch_size=2), adapters)
    runner = RangesRunner(a["base"], batch_size=2, ranges=[(0, 1), (1, 2)])
    try:
        got = _outputs(runner, adapters)
        records = runner.records()
        memory = runner.memory()
    finally:
        runner.close()
    _same(got, want)
    assert want[1] != want[2] and want[0] != want[1]  # the adapters change the outputs: the check can fail
    assert [r["range"] for r in records] == [[0, 1], [1, 2]]
    assert [r["built"] for r in records] == [{0: 1}, {1: 1}]  # switching never re-read a layer
    assert [r["adapters"] for r in records] == [{"eval0": [0], "eval1": [0]}, {"eval0": [1], "eval1": [1]}]
    assert all(m["peak_bytes"] is None or m["peak_bytes"] > 0 for m in memory["ranges"])


def test_ranges_must_cover_every_layer_once(ray_local):
    from moeflow.evaluation.ranges_runner import check_ranges

    assert check_ranges([[0, 3], [3, 5]], 5, "m") == [(0, 3), (3, 5)]
    for bad in ([(0, 1), (2, 5)], [(0, 3), (2, 5)], [(0, 4)], [(1, 5)], [], [(0, 0), (0, 5)]):
        with pytest.raises(UserError, match="do not cover its 5 decoder layers"):
            check_ranges(bad, 5, "m")


def test_layout_setting_keeps_the_earlier_streamed_switch():
    base = {"model": {"path": str(assets()["base"])}}
    assert validate(dict(base, regress={"streamed": "always"})).regress.layout_setting == "streamed"
    assert validate(dict(base, regress={"streamed": "never"})).regress.layout_setting == "whole"
    assert validate(dict(base, regress={"layout": "ranges"})).regress.layout_setting == "ranges"
    assert validate(dict(base, regress={"streamed": "always", "layout": "streamed"})).regress.layout_setting \
        == "streamed"
    with pytest.raises(UserError, match="regress.streamed never contradicts regress.layout ranges"):
        validate(dict(base, regress={"streamed": "never", "layout": "ranges"}))


def test_pack_ranges_fills_devices_and_balances():
    from moeflow.parallel.stage_prices import pack_ranges

    assert pack_ranges([1.0] * 10, 3.0) == [(0, 2), (2, 5), (5, 7), (7, 10)]  # the fewest, 2-3 each (not 3+3+3+1)
    assert pack_ranges([1.0] * 40, 3.0) == [(a, b) for a, b in pack_ranges([1.0] * 40, 3.0) if b - a in (2, 3)]
    assert pack_ranges([1.0] * 10, 7.0) == [(0, 5), (5, 10)]  # 2 ranges, balanced (not 7 + 3)
    assert pack_ranges([2.0, 1.0, 1.0, 1.0, 1.0], 4.0) == [(0, 2), (2, 5)]
    assert pack_ranges([4.0, 1.0, 1.0], 3.0) == [(0, 1), (1, 3)]  # a layer over the cap: alone
    assert pack_ranges([], 3.0) == []


@pytest.fixture(scope="module")
def reference():
    from workflows.dryrun import dry_run

    return dry_run(load_config(REFERENCE))


def test_reference_regress_runs_over_resident_ranges_in_minutes(reference):
    """The reference (5.6 TB, one bf16 decoder layer 79 GB, 128 GB devices): auto picks ranges
    of one layer each, 2 shards x (ranges + 1) devices of the 384; the checkpoints are read once
    per shard, not once per pass: minutes, not 15 h."""
    from moeflow.parallel.stage_prices import regress_plan

    est, inp = reference
    reg = next(s for s in est.stages if s.name == "regress")
    lay = regress_plan(inp)
    assert lay.kind == "ranges" and lay.ranges[0][0] == 0 and lay.ranges[-1][1] == inp.spec.layers
    assert all(b == c for (_, b), (c, _) in zip(lay.ranges, lay.ranges[1:]))
    assert "ranges of layers resident per shard" in reg.placement
    assert reg.devices == 2 * (len(lay.ranges) + 1) <= 384
    assert max(lay.range_bytes) <= reg.memory_per_device <= 128e9
    assert reg.bytes_read == pytest.approx(2 * (inp.converted_bytes + inp.quantised_bytes))
    assert reg.seconds < 3600, [(t.what, t.seconds) for t in reg.terms]
    assert not [c for c in est.checks if c.name == "memory.regress"]


def test_reference_layout_follows_the_setting_and_the_spec():
    """layout streamed prices the read per pass again; on 16 devices the ranges do not fit the
    spec and auto streams; a model that fits one device loads whole."""
    from moeflow.parallel.stage_prices import regress_plan
    from workflows.dryrun import dry_run

    est, inp = dry_run(load_config(REFERENCE, ["regress.layout=streamed"]))
    assert regress_plan(inp).kind == "streamed"
    reg = next(s for s in est.stages if s.name == "regress")
    assert "layer-streamed" in reg.placement and reg.seconds > 10 * 3600  # every pass reads the model
    inp.hw = inp.hw.model_copy(update={"nodes": 2})
    lay = regress_plan(inp)
    assert lay.kind == "streamed" and "exceed the spec's 16" in lay.why
    inp.cfg = load_config(REFERENCE, ["regress.layout=auto"])
    inp.hw = inp.hw.model_copy(update={"memory_per_device_gb": 1e5})
    assert regress_plan(inp).kind == "whole"


def test_forced_ranges_that_need_more_devices_than_the_spec_are_refused(reference):
    """regress.layout ranges with 6 shards asks 6 x 72 devices of the reference's 384: the dry
    run refuses it (exit 2), naming the devices and the settings that fix it; auto streams."""
    from workflows.dryrun import dry_run

    est, _ = dry_run(load_config(REFERENCE, ["regress.layout=ranges", "regress.shards=6"]))
    refused = [c for c in est.refused if c.name == "devices.regress"]
    assert len(refused) == 1 and "432 devices, over the 384" in refused[0].message
    assert "regress.layout auto" in refused[0].message and "regress.shards (6)" in refused[0].message
    est, _ = dry_run(load_config(REFERENCE, ["regress.shards=6"]))
    assert not [c for c in est.checks if c.name.startswith("devices.")]
    assert not [c for c in reference[0].checks if c.name.startswith("devices.")]


@pytest.mark.slow  # a minute or more: three regress stages, Ray actors on 2 cores
def test_ranges_regress_gives_the_in_memory_verdict_and_metrics(tmp_path, mlflow_uri, ray_local):
    """The stage with regress.layout ranges on a device smaller than one layer (one range per
    layer): the in-memory run's metrics and verdict; a damaging adapter still fails."""
    from tests.test_regress_stage import _ctx, _in_run
    from tests.test_streamed import small_device_spec

    small = str(small_device_spec(tmp_path / "small.yaml", 1e-4))
    runs = {}
    for name, adapter, over in (("whole", "good", {}), ("ranges", "good", {"hardware": small}),
                                ("random", "random", {"hardware": small})):
        (tmp_path / name).mkdir()
        ctx = _ctx(tmp_path / name, mlflow_uri, adapter, layout="whole" if name == "whole" else "ranges")
        if over:
            ctx.config = ctx.config.model_copy(update={"hardware": ctx.config.hardware.model_copy(
                update={"spec": over["hardware"]})})
        runs[name], _ = _in_run(mlflow_uri, ctx)
    whole, ranges = runs["whole"], runs["ranges"]
    assert isinstance(whole, dict) and isinstance(ranges, dict), (whole, ranges)
    assert ranges["layout"] == "ranges" and [tuple(r) for r in ranges["ranges"]] == [(0, 1), (1, 2)]
    assert whole["layout"] == "whole" and ranges["passed"] is whole["passed"] is True
    for key in ("metrics", "base_metrics"):
        assert whole[key].keys() == ranges[key].keys()
        for k, v in whole[key].items():
            assert math.isclose(v, ranges[key][k], rel_tol=1e-5, abs_tol=1e-5), (k, v, ranges[key][k])
    assert isinstance(runs["random"], UserError)
    assert "regressed vs base: reverse_nll/bits_per_byte" in str(runs["random"])
