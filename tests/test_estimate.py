"""The dry run's estimator (moeflow/parallel/estimate.py) and its inputs (workflows/dryrun.py): pure,
no Ray; the model is built on the meta device from shipped config.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeflow.core.config import load_config
from moeflow.parallel.estimate import StageEstimate, Term, critical_path
from workflows.dryrun import count_tokens, dry_run

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "configs" / "reference-2.8t.yaml"
DEMO = REPO / "configs" / "demo.yaml"
DEMO_BASE = REPO / "assets" / "demo-base"
EIGHT = ["convert", "plan", "operators", "calibrate", "finetune", "regress", "serving", "deploy"]


def stage(name, seconds, upstream=()):
    return StageEstimate(name, "-", 1, 1, 0.0, 0.0, 0.0, terms=[Term("t", seconds, "assumed: x")],
                         upstream=tuple(upstream))


def test_critical_path_takes_the_longer_side_branch():
    stages = [stage("a", 10), stage("ft", 100, ["a"]), stage("cal", 30, ["a"]),
              stage("reg", 5, ["ft", "cal"])]
    assert critical_path(stages) == (["a", "ft", "reg"], 115)
    stages[2] = stage("cal", 300, ["a"])
    assert critical_path(stages) == (["a", "cal", "reg"], 315)


@pytest.fixture(scope="module")
def reference():
    est, inp = dry_run(load_config(REFERENCE))
    return est, inp


def test_reference_prices_all_eight_stages_on_384_devices(reference):
    est, inp = reference
    d = est.as_dict()
    assert [s["stage"] for s in d["stages"]] == EIGHT
    assert d["world"] == 384 and inp.counts.total > 2.8e12
    by = {s["stage"]: s for s in d["stages"]}
    assert by["finetune"]["devices"] == 384 and by["finetune"]["nodes"] == 48
    for s in d["stages"]:
        assert s["seconds"] > 0 and s["basis"].split(":")[0] in ("measured", "published", "assumed")
        assert all(t["basis"] for t in s["terms"])
        assert s["cost"] == pytest.approx(2.0 * s["device_hours"])  # the spec's price
    # the finetune plan fits its devices; the checkpoint's size is params x bf16
    assert by["finetune"]["memory_per_device_bytes"] < 128e9
    assert by["convert"]["bytes_written"] == pytest.approx(inp.converted_bytes)
    assert inp.converted_bytes == pytest.approx(2 * inp.counts.total, rel=0.01)
    # finetune and calibrate side by side: the wall is not their sum
    secs = {s["stage"]: s["seconds"] for s in d["stages"]}
    assert d["wall_s"] < sum(secs.values())
    assert d["wall_s"] >= sum(secs[n] for n in d["critical_path"])
    assert ("finetune" in d["critical_path"]) != ("calibrate" in d["critical_path"])
    assert d["booked_device_hours"] == pytest.approx(384 * d["wall_s"] / 3600)
    # every stage runs as planned at this size: nothing refused, nothing over a device, no
    # memory warning (calibrate splits each layer's experts, regress and operators stream
    # layers, the serving search and deploy run vLLM engines of the plan's layout)
    assert not est.failed and not est.refused, [c.message for c in est.failed]
    assert all(s["memory_per_device_bytes"] <= 128e9 for s in d["stages"])
    assert not [c for c in est.checks if c.name.startswith("memory") and c.status != "ok"]


def test_reference_checks_name_what_a_real_run_would_meet(reference):
    est, _ = reference
    checks = {c.name: c for c in est.checks}
    assert checks["space"].status == "ok" and "200 TB" in checks["space"].message
    assert "memory.operators" not in checks  # layer-streamed: one layer, not 5.6 TB
    assert checks["data.main"].status == "warn" and "not found" in checks["data.main"].message
    assert {"slo.tpot", "slo.ttft", "slo.throughput", "slo.burst"} <= set(checks)


def test_reference_streams_operators_and_regress_and_splits_calibrate_inside_layers(reference):
    """Where the model exceeds a device the figures follow what runs: operators and regress hold
    the front and one decoder layer (bf16), regress reading every layer once per pass; calibrate
    splits each float32 layer's 896 experts into the fewest groups whose worker fits 128 GB."""
    from moeflow.parallel.footprint import unit_params

    est, inp = reference
    by = {s.name: s for s in est.stages}
    layer, outer = unit_params(inp.spec)
    assert inp.spec.layers * layer > 0.9 * (inp.counts.total - outer)  # layers hold the bulk
    assert 4 * layer > 128e9 > 2 * layer  # one layer: over a device in float32, under in bf16
    ops = by["operators"]
    assert "layer-streamed" in ops.placement
    assert 2 * (layer + outer) < ops.memory_per_device <= 128e9
    cal = by["calibrate"]
    assert "16 workers: 8 ranges of layers x 2 expert groups" in cal.placement and cal.devices == 17
    assert 4 * layer / 2 < cal.memory_per_device <= 128e9  # half a layer's experts in float32
    # regress auto runs over resident layer ranges here (tests/test_regress_ranges.py); streamed:
    streamed, _ = dry_run(load_config(REFERENCE, ["regress.layout=streamed"]))
    reg = next(s for s in streamed.stages if s.name == "regress")
    assert "layer-streamed" in reg.placement and 2 * layer < reg.memory_per_device <= 128e9
    read = next(t for t in reg.terms if "passes" in t.what)
    # the golden suite: 2 generation tasks of 6 tokens, 4 scoring tasks, 1 image task (skipped)
    passes = inp.suite["streamed_passes"]
    assert passes == 2 * 6 + 4 and f"3 models x {passes} passes" in read.what
    assert read.seconds == pytest.approx(3 * passes * inp.converted_bytes / 5e9)  # 5 GB/s per node
    whole, _ = dry_run(load_config(REFERENCE, ["operators.streamed=never", "calibrate.layer_workers=1",
                                               "calibrate.expert_groups=1"]))
    ops_whole = next(s for s in whole.stages if s.name == "operators")
    assert ops_whole.memory_per_device > inp.converted_bytes and "layer-streamed" not in ops_whole.placement
    refused = {c.name: c.message for c in whole.refused}  # refused, not warned, naming the fix
    assert "set it auto" in refused["memory.operators"]
    assert "calibrate.expert_groups auto" in refused["memory.calibrate"]


def test_a_reference_setting_or_device_that_cannot_fit_is_refused_naming_the_fix(tmp_path):
    """The reference fits its 128 GB devices; on 64 GB devices the streamed stages (one bf16
    layer is 79 GB) are refused naming the spec, and a float32 regress names regress.dtype."""
    import yaml

    spec = yaml.safe_load((REPO / "cluster" / "hardware" / "supernode-384.yaml").read_text())
    small = tmp_path / "supernode-64g.yaml"
    small.write_text(yaml.safe_dump({**spec, "name": "supernode-64g", "memory_per_device_gb": 64}))
    est, _ = dry_run(load_config(REFERENCE, [f"hardware={small}"]))
    refused = {c.name: c.message for c in est.refused}
    assert {"memory.operators", "memory.regress"} <= set(refused), refused
    for name in ("operators", "regress"):
        assert refused[f"memory.{name}"].startswith(f"{name} needs ")
        assert "over 64 GB on supernode-64g" in refused[f"memory.{name}"]
        assert "hardware.spec with larger devices" in refused[f"memory.{name}"]
    est, _ = dry_run(load_config(REFERENCE, ["regress.dtype=float32"]))
    refused = {c.name: c.message for c in est.refused}
    assert list(refused) == ["memory.regress"] and "set regress.dtype bfloat16" in refused["memory.regress"]


def test_finetune_micro_batch_the_plan_did_not_assume_fails():
    est, _ = dry_run(load_config(REFERENCE, ["finetune.micro_batch_size=4",
                                             "finetune.gradient_checkpointing=false"]))
    fail = {c.name: c for c in est.failed}
    assert "memory.finetune" in fail and "micro_batch_size 4" in fail["memory.finetune"].message


def test_overrides_are_named_assumptions_and_change_the_estimate(reference):
    base, _ = reference
    est, _ = dry_run(load_config(REFERENCE, ["estimate.storage_read_gbs=10",
                                             "estimate.storage_free_gb=1000",
                                             "estimate.price_per_device_hour=3"]))
    read = {s.name: next(t for t in s.terms if t.what.startswith("read the checkpoint"))
            for s in (base.stages[0], est.stages[0])}
    assert read["convert"].basis.startswith("assumed")
    old = next(t for t in base.stages[0].terms if t.what.startswith("read the checkpoint"))
    assert read["convert"].seconds == pytest.approx(old.seconds / 2)
    assert est.price == 3
    space = next(c for c in est.checks if c.name == "space")
    assert space.status == "fail" and "1 TB free" in space.message


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO_BASE / "tokenizer.json"))


def test_count_tokens_tokenises_the_training_text(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    recs = [{"prompt": "min: a b c\nanswer:", "completion": " a", "task": "min"},
            {"messages": [{"role": "user", "content": "reverse: abc"},
                          {"role": "assistant", "content": "cba"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    texts = ["min: a b c\nanswer:", " a", "reverse: abc", "cba"]
    want = sum(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in texts)
    assert count_tokens(path, tokenizer, 4.0) == (want, "tokenizer")
    tokens, basis = count_tokens(path, None, 4.0)
    assert tokens == path.stat().st_size / 4 and "bytes per token" in basis


def demo_config(tmp_path, train: Path, *extra: str):
    return load_config(DEMO, [f"model.path={DEMO_BASE}", f"data.train_file={train}",
                              f"finetune.adapters.reverse.train_file={train}",
                              f"workdir={tmp_path / 'runs'}", *extra])


@pytest.fixture
def host_at(monkeypatch):
    """Pin the dry run's host probe to `factor` x the anchor's: what the estimator does with a
    host factor is tested, never how fast this host happens to be (a shared host varies 2-3x)."""
    from moeflow.parallel import estimate as E

    def pin(factor: float) -> None:
        monkeypatch.setattr("workflows.dryrun.probe_host", lambda: E.ANCHOR_PROBE_S * factor)
    return pin


def test_demo_checks_data_rows_and_bursts(tmp_path, host_at):
    host_at(1.0)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "min: a b", "completion": " a"}) + "\n")
    est, inp = dry_run(demo_config(tmp_path, train))
    checks = {c.name: c for c in est.checks}
    assert inp.lora.plan.dp == 2
    assert checks["data.main"].status == "fail" and "2 data-parallel ranks" in checks["data.main"].message
    assert checks["slo.burst"].status == "warn"  # 64 at once vs 1 replica x 16 sequences
    assert checks["space"].status == "ok" and "local disk" in checks["space"].message
    by = {s.name: s for s in est.stages}
    assert by["finetune"].placement.startswith("Ray Train 2 workers")
    assert by["serving"].terms[0].seconds == pytest.approx(40)  # serving.budget_s
    assert est.price is None and est.as_dict()["cost"] is None
    assert inp.src_basis == "its files"

    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"prompt": f"min: {i} {i + 1}", "completion": f" {i}"}) + "\n"
                            for i in range(400)))
    est, _ = dry_run(demo_config(tmp_path, many, "deploy.max_num_seqs=64"))
    checks = {c.name: c for c in est.checks}
    assert checks["data.main"].status == "warn" and "passes" in checks["data.main"].message
    assert checks["slo.burst"].status == "ok"


def test_bench_contention_factor_is_the_slowdown_of_the_demo_threads():
    from benchmarks.bench_dryrun import Contention

    c = Contention(root=1)
    c.cores = 2
    c.samples = [(1.0, 1, 0), (2.0, 2, 6), (3.0, 1, 3), (4.0, 0, 1)]
    assert c.factor(0, 1.5) == 1.0  # alone on an idle host
    assert c.factor(1.5, 2.5) == 4.0  # 2 threads beside 6 on 2 cores: a quarter of their rate
    assert c.factor(2.5, 3.5) == 2.0  # 1 thread beside 3
    assert c.factor(3.5, 4.5) == 1.0  # 1 + 1 threads fit 2 cores
    assert c.factor(10, 11) is None  # no samples


def test_host_costs_follow_this_hosts_probe_on_the_anchor_spec_only(tmp_path, reference):
    """On the anchor's spec (cpu-local) every host-measured term and the CPU's FLOP/s scale by
    this host's probe against the anchor's; a wall-clock budget and storage do not; another spec
    (the reference's 384 devices) never probes and keeps the measured costs as they are."""
    import dataclasses

    from moeflow.parallel import estimate as E

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"min: {i} {i + 1}", "completion": f" {i}"}) + "\n"
                             for i in range(400)))
    est, inp = dry_run(demo_config(tmp_path, train))
    assert inp.hw.name == E.ANCHOR_HOST and inp.host_probe_s and inp.host_probe_s > 0
    at_anchor = E.estimate(dataclasses.replace(inp, host_probe_s=E.ANCHOR_PROBE_S))
    half = E.estimate(dataclasses.replace(inp, host_probe_s=E.ANCHOR_PROBE_S / 2))
    for a, h in zip(at_anchor.stages, half.stages):
        for ta, th in zip(a.terms, h.terms):
            if ta.const or "FLOP/s" in ta.basis:  # a host-measured constant, or compute
                assert th.seconds == pytest.approx(ta.seconds / 2), (a.name, ta.what)
            else:
                assert th.seconds == pytest.approx(ta.seconds), (a.name, ta.what)
    assert any("x0.50 by this host's probe" in t.basis for s in half.stages for t in s.terms)
    serve = {e: next(s for s in x.stages if s.name == "serving") for e, x in (("a", at_anchor), ("h", half))}
    assert serve["h"].terms[0].seconds == serve["a"].terms[0].seconds == pytest.approx(40)
    assert "x0.500" in half.assumptions["host_speed"]
    _, ref = reference
    assert ref.host_probe_s is None and "x1" in reference[0].assumptions["host_speed"]


def test_a_compiled_deploy_prices_the_replicas_warm_up(tmp_path, host_at):
    """deploy.compile adds one warm-up per replica to deploy and to each of serving's two
    deployments, scaled like every host cost (here a host pinned at 1.5x the anchor's time)."""
    from moeflow.parallel.estimate import COMPILE_WARMUP_S

    host_at(1.5)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "min: a b", "completion": " a"}) + "\n")
    eager, _ = dry_run(demo_config(tmp_path, train))
    compiled, _ = dry_run(demo_config(tmp_path, train, "deploy.compile=true"))
    def seconds(est, name, term=None):
        stage = next(s for s in est.stages if s.name == name)
        return stage.seconds if term is None else next(t.seconds for t in stage.terms if term in t.what)
    assert seconds(eager, "deploy", "compiles its forwards") == 0
    warm_up = 1.5 * COMPILE_WARMUP_S
    assert seconds(compiled, "deploy", "compiles its forwards") == pytest.approx(warm_up)
    assert seconds(compiled, "deploy") - seconds(eager, "deploy") == pytest.approx(warm_up)
    # serving deploys the default and one candidate: twice the warm-up, past its 40 s budget
    assert seconds(compiled, "serving", "search") >= 2 * warm_up > seconds(eager, "serving", "search")


def test_engine_process_auto_prices_a_core_process_only_for_text_models(tmp_path, host_at):
    """deploy.engine_process: auto starts an engine core beside each replica for a text model
    and serves an image-text model in the replica's own process: only the first pays the start."""
    import dataclasses

    from moeflow.parallel import estimate as E

    host_at(1.0)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "min: a b", "completion": " a"}) + "\n")
    _, inp = dry_run(demo_config(tmp_path, train))

    def core(inp) -> float:
        deploy = E.deploy(inp, E.Rates(inp))
        return next(t.seconds for t in deploy.terms if "engine core" in t.what)

    assert inp.cfg.deploy.engine_process == "auto" and not inp.counts.vision
    assert core(inp) == pytest.approx(E.CORE_START_S)
    vision = dataclasses.replace(inp.counts, by_kind={**inp.counts.by_kind, "vision": 1_000_000})
    assert vision.vision and core(dataclasses.replace(inp, counts=vision)) == 0
    forced = inp.cfg.model_copy(update={"deploy": inp.cfg.deploy.model_copy(update={"engine_process": True})})
    assert core(dataclasses.replace(inp, counts=vision, cfg=forced)) == pytest.approx(E.CORE_START_S)


def test_the_suites_price_does_not_depend_on_where_the_repository_lies(tmp_path):
    """The regress suite's size is its records' text: a clone in a longer directory (CI's) prices
    the same, although the image records resolve their paths against it."""
    import shutil

    from moeflow.evaluation.suite import GOLDEN_SUITE
    from workflows.dryrun import _suite

    here = load_config(REFERENCE)
    far = tmp_path / ("a-much-longer-checkout-directory-" * 3) / "suites"
    shutil.copytree(GOLDEN_SUITE.parent.parent, far)
    moved = load_config(REFERENCE, [f"regress.suite={far / GOLDEN_SUITE.relative_to(GOLDEN_SUITE.parent.parent)}"])
    assert _suite(moved) == _suite(here)
