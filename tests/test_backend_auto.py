"""`deploy.backend: auto` and the serving backends in the dry run: moeflow's local engine where
one replica fits one device (priced on the one device it uses), vLLM with the plan's TP/PP/EP
where it does not (TTFT / TPOT from the cost model), and the local engine never started on a
model too large for it. Pure: models on the meta device, records as dicts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from moeflow.core.config import load_config
from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.model.params import spec_from_path
from moeflow.parallel.memory import Plan
from moeflow.parallel.planner import plan_with_degrees
from moeflow.parallel.vllm_plan import LOCAL, choose_backend, prefill_seconds, vllm_serving_plan
from moeflow.serving.deployment import decide
from tasks.plan import local_workload, plan_source, serving_plan, workload_from_config
from tests.test_dryrun_refuse import demo, spec_file
from workflows.dryrun import dry_run

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "configs" / "reference-2.8t.yaml"


@pytest.fixture(scope="module")
def reference():
    cfg = load_config(REFERENCE)
    return cfg, spec_from_path(plan_source(cfg)), load_hardware(cfg.hardware.spec, cfg.hardware.nodes)


def test_auto_is_the_default_and_picks_by_one_devices_memory(tmp_path, reference):
    cfg, spec, hw = reference
    assert cfg.deploy.backend == "auto"
    big = choose_backend("auto", spec, hw, local_workload(cfg, hw))
    assert big["backend"] == "vllm" and not big["local_fits"] and big["local_memory_bytes"] > 5e12
    assert "5.93 TB" in big["why"] and "128 GB" in big["why"]
    d = demo(tmp_path, REPO / "cluster" / "hardware" / "cpu-local.yaml")
    dspec, dhw = spec_from_path(str(REPO / "assets" / "demo-base")), load_hardware("cpu-local")
    small = choose_backend("auto", dspec, dhw, local_workload(d, dhw))
    assert small["backend"] == "local" and small["local_fits"]
    assert local_workload(d, dhw).weight_dtype == "fp32"  # the local engine computes in fp32 on CPU
    # explicit choices are kept, and say whether the local engine could hold the model
    assert choose_backend("local", spec, hw, local_workload(cfg, hw))["local_fits"] is False
    assert choose_backend("vllm", dspec, dhw, local_workload(d, dhw))["backend"] == "vllm"


def test_the_plan_stage_records_the_choice(reference):
    cfg, spec, hw = reference
    work = replace(workload_from_config(cfg), mode="inference")
    result = plan_with_degrees(spec, hw, work, {}, cfg.plan.runtime)
    rec = serving_plan(cfg, spec, hw, result, plan_source(cfg))
    assert rec["backend"] == "vllm" and rec["local_fits"] is False and rec["device_gb"] == 128
    assert rec["vllm"]["ttft_s"] > 0 and "auto" in rec["backend_why"]


def _records(backend: str, fits: bool) -> dict:
    serving = {"backend": backend, "local_fits": fits, "local_memory_gb": 5930.0, "device_gb": 128.0}
    return {"convert": {"output_dir": "/w/convert"}, "plan": {"plan": {"serving": serving}}}


def test_deploy_serves_what_the_plan_chose_and_never_a_too_large_model_locally(tmp_path):
    cfg = load_config(REFERENCE)
    assert decide(cfg, _records("vllm", False)).backend == "vllm"
    assert decide(cfg, _records("local", True)).backend == "local"
    with pytest.raises(UserError, match="plan record does not say"):  # a plan of an older version
        decide(cfg, {"convert": {"output_dir": "/w/convert"}, "plan": {"plan": {"serving": {}}}})
    local = load_config(REFERENCE, ["deploy.backend=local"])
    with pytest.raises(UserError, match=r"needs 5.93 TB, over 128 GB per device; set deploy.backend auto"):
        decide(local, _records("vllm", False))
    # the deploy stage stops on that line before it touches Ray or starts a replica
    from tasks.deploy import run

    ctx = SimpleNamespace(config=local, inputs=_records("vllm", False))
    with pytest.raises(UserError, match="the local engine holds the whole model on one device"):
        run(ctx)


def test_the_local_engine_claims_one_device_per_replica(tmp_path):
    est, inp = dry_run(demo(tmp_path, spec_file(tmp_path, "roomy", 64.0), "deploy.num_replicas=3"))
    by = {s.name: s for s in est.stages}
    assert inp.serve["backend"] == "local"
    assert by["deploy"].devices == 3 and "3 replica(s) x 1 device(s)" in by["deploy"].placement
    assert "local engine, the whole model on one device" in by["deploy"].placement
    assert by["serving"].devices == 3


def test_vllm_dry_run_of_the_reference_has_ttft_and_tpot_from_its_layout(reference):
    cfg, spec, hw = reference
    est, inp = dry_run(load_config(REFERENCE, ["deploy.backend=vllm"]))
    s = inp.serve
    assert s["backend"] == "vllm" and s["ttft_s"] > 0 and s["tpot_s"] > 0
    v = vllm_serving_plan(spec, hw, replace(workload_from_config(cfg), mode="inference"))
    assert s["devices_per_replica"] == v["devices_per_replica"] and s["ttft_s"] == v["ttft_s"]
    by = {x.name: x for x in est.stages}
    assert by["deploy"].devices == s["replicas"] * v["devices_per_replica"]
    assert f"TP{v['tensor_parallel']} PP{v['pipeline_parallel']} EP{v['expert_parallel']}" in by["deploy"].placement
    checks = {c.name: c for c in est.checks}
    assert "planned prefill" in checks["slo.ttft"].message and "planned TPOT" in checks["slo.tpot"].message
    auto, _ = dry_run(load_config(REFERENCE))  # auto resolves to the same vLLM plan
    assert [x.placement for x in auto.stages if x.name == "deploy"] == [by["deploy"].placement]


def test_prefill_splits_over_tp_and_ep_and_pipelines_chunks(reference):
    cfg, spec, hw = reference
    # a long prompt: compute, not reading the weights once per chunk, bounds each chunk-step
    work = replace(workload_from_config(cfg), mode="inference", context=32768, prefill_chunk=16384)
    from moeflow.parallel.memory import memory_for_plan

    def ttft(p: Plan, w=work) -> float:
        return prefill_seconds(spec, hw, p, w, memory_for_plan(spec, p, w, 1e15, 0))

    one = ttft(LOCAL)
    assert ttft(Plan(tp=8, dp=48)) < one / 4  # attention and experts over 8 TP ranks
    assert ttft(Plan(tp=1, ep=16, dp=384)) < one  # the experts' share over 16 EP ranks
    # chunks pipeline through the stages: (C + PP - 1) chunk-steps of one stage
    assert ttft(Plan(tp=1, pp=4, dp=96)) == pytest.approx(one * (2 + 3) / 2 / 4, rel=0.05)
    # one chunk: one step, half the tokens of two
    assert ttft(LOCAL, replace(work, prefill_chunk=32768)) == pytest.approx(one, rel=0.05)
    # a short prompt on one device: bound by reading its weights (5.6 TB at 3.2 TB/s) per chunk
    short = replace(work, context=2048, prefill_chunk=2048)
    assert ttft(LOCAL, short) == pytest.approx(5.64e12 / 3.2e12, rel=0.02)


def test_the_serving_search_prices_the_backend_that_serves(tmp_path, reference):
    """On a model larger than one device the serving search brings up vLLM candidates of the
    plan's layout (each a vLLM start, its weights and its share of the traffic), priced on
    their devices and memory; the local backend there is refused, serving and deploy naming
    deploy.backend; on the demo (one device holds it) the search stays on the local engine."""
    est, inp = dry_run(load_config(REFERENCE))
    by = {s.name: s for s in est.stages}
    assert inp.serve["backend"] == "vllm" and inp.serve["search"]["layout"].startswith("vLLM TP")
    serving = by["serving"]
    assert serving.placement.startswith("Ray Serve LLM (vllm): 2+ candidates x ")
    assert serving.memory_per_device == inp.serve["memory_bytes"] <= 128e9
    assert serving.devices == by["deploy"].devices == inp.serve["replicas"] * inp.serve["devices_per_replica"]
    terms = {t.what: t for t in serving.terms}
    start = next(t for w, t in terms.items() if w.startswith("vLLM engine start"))
    assert start.seconds == pytest.approx(2 * 120.0) and start.basis == "assumed: estimate.vllm_start_s"
    assert any(w.startswith("2 candidates load the weights") for w in terms)
    assert not est.refused

    local, _ = dry_run(load_config(REFERENCE, ["deploy.backend=local"]))
    refused = {c.name: c.message for c in local.refused}
    assert {"memory.serving", "memory.deploy"} <= set(refused)
    assert all("set deploy.backend auto or vllm" in refused[k] for k in ("memory.serving", "memory.deploy"))
    small, sinp = dry_run(demo(tmp_path, spec_file(tmp_path, "roomy", 64.0)))
    assert not small.refused and sinp.serve["backend"] == "local"
    assert next(s for s in small.stages if s.name == "serving").placement.startswith("Ray Serve (local)")


def test_the_serving_stage_refuses_local_candidates_of_a_model_over_one_device():
    """deploy.backend local on the reference: the stage stops before any candidate starts (auto
    resolves to vLLM, whose candidates it searches instead: tests/test_vllm_search.py)."""
    from tasks.serving import run

    ctx = SimpleNamespace(config=load_config(REFERENCE, ["deploy.backend=local"]), inputs=_records("vllm", False))
    with pytest.raises(UserError, match=r"serving: one replica needs 5,930.0 GB on one device, over 128 GB"):
        run(ctx)
