"""The serving search's pure parts: traffic profiles, request generation, vllm-named
metrics, candidate generation under the plan's memory, the choice, the renderings
(Ray Serve LLM config validated by Ray's own model) and deploy's serving.yaml overlay."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import yaml

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from moeflow.core.sections.deploy import DeploySection
from moeflow.serving.loadgen import Result, format_result, parse_goodput, random_requests, summarize
from moeflow.serving.traffic import Request, generate, load_profile, validate_profile
from moeflow.serving.tune import Candidate, choose
from moeflow.serving.tune_space import Limits, make_candidates

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "traffic" / "demo.yaml"


def _raw() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_demo_profile_draws_its_mix_deterministically():
    prof = load_profile(DEMO)
    reqs = generate(prof, models=["base", "main", "reverse"], base="base", vocab=512, max_model_len=512)
    again = generate(prof, models=["base", "main", "reverse"], base="base", vocab=512, max_model_len=512)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]
    assert len(reqs) == prof.num_requests
    docs = [r for r in reqs if r.klass == "document"]
    chat = [r for r in reqs if r.klass == "chat"]
    assert 0.05 < len(docs) / len(reqs) < 0.16
    assert all(16 <= len(r.prompt) <= 48 and 64 <= r.max_tokens <= 96 for r in chat)
    assert all(300 < len(r.prompt) <= 440 and r.max_tokens == 64 and len(r.prompt) + r.max_tokens <= 512 for r in docs)
    # zipf over the served adapters (base excluded): the first twice as popular as the second
    share = sum(r.model == "main" for r in reqs) / len(reqs)
    assert {r.model for r in reqs} == {"main", "reverse"} and 0.58 < share < 0.75
    # bursts of 64 at one instant, more than the deploy: default's 2 replicas x 16 sequences admit
    size = prof.arrivals.burst_size
    starts = sorted({r.arrival_s for r in reqs})
    assert size > 2 * DeploySection().max_num_seqs and len(starts) == len(reqs) // size
    assert all(sum(r.arrival_s == t for r in reqs) == size for t in starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]  # mean burst_size / rate, steadier than Poisson
    assert statistics.fmean(gaps) == pytest.approx(size / prof.arrivals.rate, rel=0.5)


def test_burst_arrivals_and_runs_cut_at_whole_bursts():
    import random

    from moeflow.serving.traffic import arrival_times
    from moeflow.serving.tune import Driver
    times = arrival_times(40, 10.0, 1.0, random.Random(0), "bursts", burst_size=8)
    assert [len([t for t in times if t == s]) for s in sorted(set(times))] == [8] * 5
    gaps = [b - a for a, b in zip(sorted(set(times)), sorted(set(times))[1:])]
    assert all(g > 0 for g in gaps)
    many = arrival_times(8000, 10.0, 1.0, random.Random(1), "bursts", burst_size=8)
    starts = sorted(set(many))
    assert (starts[-1] - starts[0]) / (len(starts) - 1) == pytest.approx(0.8, rel=0.1)  # size / rate
    raw = dict(_raw(), arrivals={"process": "gamma", "rate": 4, "burst_size": 3})
    with pytest.raises(UserError, match="burst_size needs process: bursts"):
        validate_profile(raw)
    prof = load_profile(DEMO)
    d = Driver(prof, models=["b", "m"], base="b", vocab=100, max_model_len=512, api_key=None)
    assert len(d.requests(prof.arrivals.rate, 0.1)) == 64  # a probe is at least one whole burst
    assert len(d.requests(prof.arrivals.rate, 5.0)) == 128  # 80 requests -> two bursts


@pytest.mark.parametrize("edit, key", [
    (lambda r: r["arrivals"].update(rate=-1), "`arrivals.rate`"),
    (lambda r: r["mix"][0].update(promt_len=3), "`mix.0.promt_len`: unknown key"),
    (lambda r: r["mix"][1]["prompt_len"].update(dist="zipf"), "`mix.1.prompt_len`"),
    (lambda r: r["mix"][0]["output_len"].update(range_ratio=1.5), "`mix.0.output_len.range_ratio`"),
    (lambda r: r.update(duration_s=10), "exactly one of num_requests, duration_s"),
    (lambda r: r["slo"].update(ttft_ms=None, tpot_ms=None), "`slo`"),
    (lambda r: r["adapters"].update(popularity="weights"), "`adapters`: Value error, popularity: weights"),
    (lambda r: r["mix"][0].update(prompt_len={"dist": "jsonl", "path": "/nonexistent.jsonl"}),
     "`mix.0.prompt_len.path`: /nonexistent.jsonl does not exist"),
])
def test_malformed_profile_is_one_line_naming_the_key(edit, key):
    raw = _raw()
    edit(raw)
    with pytest.raises(UserError) as exc:
        validate_profile(raw, "p.yaml")
    assert key in str(exc.value) and "\n" not in str(exc.value)


def test_real_prompts_weights_and_unserved_adapters(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "summarise this"}\n')
    raw = _raw()
    raw["mix"] = [{"name": "real", "share": 1, "prompt_len": {"dist": "jsonl", "path": str(tmp_path / "p.jsonl")},
                   "output_len": {"dist": "fixed", "value": 4}}]
    raw["adapters"] = {"popularity": "weights", "weights": {"a": 1, "b": 0}}
    prof = validate_profile(raw)
    reqs = generate(prof, models=["base", "a", "b"], base="base", vocab=100, num_requests=30)
    assert {r.prompt for r in reqs} <= {"hello there", "summarise this"}
    assert {r.model for r in reqs} == {"a"} and all(r.max_tokens == 4 for r in reqs)
    with pytest.raises(UserError, match="'b' is not served"):
        generate(prof, models=["base", "a"], base="base", vocab=100)


def _result(ttft, e2el, tokens, ok=True) -> Result:
    return Result(Request(0, "m", [1, 2], tokens, "c"), ok=ok, ttft=ttft, e2el=e2el,
                  itl=[(e2el - ttft) / max(1, tokens - 1)] * (tokens - 1), output_tokens=tokens, prompt_tokens=2)


def test_summary_uses_vllm_names_and_goodput_counts_requests_meeting_every_slo():
    results = [_result(0.1, 0.5, 5), _result(0.4, 0.8, 5), _result(0.1, 2.1, 5), _result(0, 0, 0, ok=False)]
    slo = parse_goodput(["ttft:200", "tpot:300"])
    assert slo == {"ttft": 200.0, "tpot": 300.0}
    m = summarize(results, 2.0, goodput=slo, percentiles=(50, 99))
    # good: only the first (the second misses TTFT, the third TPOT 500 ms, the fourth failed)
    assert m["request_goodput"] == pytest.approx(0.5) and m["slo_attainment"] == pytest.approx(0.25)
    assert m["completed"] == 3 and m["failed"] == 1 and m["total_output_tokens"] == 15
    assert m["median_ttft_ms"] == pytest.approx(100) and m["p99_tpot_ms"] == pytest.approx(500, rel=0.02)
    text = format_result(m, (50, 99))
    for label in ("Request throughput (req/s):", "Output token throughput (tok/s):", "Request goodput (req/s):",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 ITL (ms):",
                  "Median E2EL (ms):", "P50 E2EL (ms):", "Serving Benchmark Result"):
        assert label in text
    with pytest.raises(ValueError, match="ttft:MS"):
        parse_goodput(["latency:3"])
    reqs = random_requests(50, ["a", "b"], input_len=20, output_len=10, range_ratio=0.5, rate=10, seed=1)
    assert all(10 <= len(r.prompt) <= 30 and 5 <= r.max_tokens <= 15 for r in reqs)
    assert reqs[-1].arrival_s > 2 and {r.model for r in reqs} == {"a", "b"}


DEFAULT = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "enable_chunked_prefill": True,
           "long_prefill_token_threshold": None, "max_long_partial_prefills": 1, "num_replicas": 1,
           "max_ongoing_requests": 32}
SPACE = {"max_num_seqs": [16, 32, 64, 256], "max_num_batched_tokens": [64, 512], "enable_chunked_prefill": [True, False],
         "long_prefill_token_threshold": [None, 128], "num_replicas": [1, 2, 4], "max_ongoing_requests": [32, 128]}


def test_candidates_start_with_the_default_and_stay_inside_the_limits():
    limits = Limits(max_num_seqs=64, max_replicas=2)
    cands = make_candidates(SPACE, DEFAULT, limits, n=6, seed=0)
    assert cands[0] == DEFAULT and len(cands) == 6
    assert len({tuple(sorted(c.items(), key=str)) for c in cands}) == 6
    for c in cands[1:]:
        assert c["max_num_seqs"] <= 64 and c["num_replicas"] <= 2 and c["max_ongoing_requests"] >= c["max_num_seqs"]
        assert c["long_prefill_token_threshold"] is None or c["long_prefill_token_threshold"] <= c["max_num_batched_tokens"]
    # spread: every allowed value of a knob with few values appears
    assert {c["num_replicas"] for c in cands} == {1, 2} and {c["enable_chunked_prefill"] for c in cands} == {True, False}
    assert make_candidates(SPACE, DEFAULT, Limits(16, 1), n=50) == [DEFAULT] + [
        c for c in make_candidates(SPACE, DEFAULT, Limits(16, 1), n=50)[1:]]
    assert all(c["max_num_seqs"] == 16 for c in make_candidates(SPACE, DEFAULT, Limits(16, 1), n=50))


def test_memory_bound_from_the_plan(tmp_path):
    from moeflow.core.hardware import HardwareSpec
    from moeflow.serving.tune_space import memory_limits
    from moeflow_testing.tiny import build_debug_model

    model = build_debug_model("qwen3_moe", tmp_path / "m")
    hw = dict(name="t", devices_per_node=4, memory_per_device_gb=1.0, hbm_bandwidth_gbs=1, bf16_tflops=1,
              intra_node_bandwidth_gbs=1, inter_node_bandwidth_gbs=1, runtime_overhead_gb=0.0)
    big = memory_limits(str(model), HardwareSpec(**hw), {"tensor_parallel": 2}, 512, "fp32", "fp32")
    small = memory_limits(str(model), HardwareSpec(**dict(hw, memory_per_device_gb=0.02)), {}, 512, "fp32", "fp32")
    assert big.max_replicas == 2 and small.max_replicas == 4
    assert 0 < small.max_num_seqs < big.max_num_seqs
    assert small.max_num_seqs * small.kv_bytes_per_seq <= small.free_bytes < (small.max_num_seqs + 1) * small.kv_bytes_per_seq
    with pytest.raises(UserError, match="not even one sequence"):
        memory_limits(str(model), HardwareSpec(**dict(hw, memory_per_device_gb=1e-5)), {}, 512, "fp32", "fp32")


def _cand(name, goodput, attainment, max_rate=None, replicas=1):
    c = Candidate(name, dict(DEFAULT, num_replicas=replicas))
    c.final = {"request_goodput": goodput, "slo_attainment": attainment, "met": attainment >= 0.9, "rate": 10}
    c.max_rate = max_rate
    return c


def test_choice_best_goodput_ties_by_max_rate_and_says_when_no_slo_is_met():
    prof = load_profile(DEMO)
    d, a, b = _cand("default", 5, 0.5), _cand("c1", 9.6, 0.95, 12), _cand("c2", 9.9, 0.97, 10)
    chosen, met, msg = choose([d, a, b], d, prof, tie=0.05)
    assert chosen is a and met and "1.92x the default's" in msg
    d2 = _cand("default", 9.9, 0.97, 15)
    chosen, met, msg = choose([d2, a], d2, prof, tie=0.05)
    assert chosen is d2 and msg.startswith("the default already wins")
    x, y = _cand("default", 2, 0.2), _cand("c1", 3, 0.4)
    chosen, met, msg = choose([x, y], x, prof, tie=0.05)
    assert chosen is y and not met and msg.startswith("no candidate meets the SLOs") and "40%" in msg


def test_renderings_validate_against_ray_serve_llm_config():
    from moeflow.serving import render

    try:  # pinned: Ray 2.60's config model, importable without vLLM
        from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    except ImportError as exc:
        pytest.fail(f"ray.llm._internal.serve.core.configs.llm_config.LLMConfig moved or broke in this Ray: {exc}")
    knobs = dict(DEFAULT, max_num_seqs=64, num_replicas=2, max_ongoing_requests=128, max_long_partial_prefills=2)
    plan = {"tensor_parallel": 2, "pipeline_parallel": 1, "expert_parallel": 2}
    cfg = render.ray_llm_config(knobs, model="/models/m", served_name="m", max_model_len=4096, lora_rank=16,
                                max_loras=4, plan=plan)
    llm = LLMConfig(**cfg)
    assert llm.engine_kwargs["max_num_seqs"] == 64 and llm.engine_kwargs["long_prefill_token_threshold"] == 256
    assert "max_num_partial_prefills" not in llm.engine_kwargs and llm.engine_kwargs["enable_expert_parallel"]
    assert "max_long_partial_prefills" not in llm.engine_kwargs  # vLLM 0.29 has neither (tests/test_vllm_render.py)
    assert llm.deployment_config["max_ongoing_requests"] == 128
    assert llm.deployment_config["autoscaling_config"]["min_replicas"] == 2
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="engine_kwargs"):  # the model validates, by field
        LLMConfig(**dict(cfg, engine_kwargs="not a dict"))
    args = render.vllm_args(knobs, model="/models/m", served_name="m", adapters={"a": "/ad/a"}, max_model_len=4096,
                            lora_rank=16, max_loras=4, plan=plan)
    for flag in ("vllm serve /models/m", "--max-num-seqs 64", "--enable-chunked-prefill", "--tensor-parallel-size 2",
                 "--data-parallel-size 2", "--enable-lora", "--lora-modules a=/ad/a", "--enable-expert-parallel"):
        assert flag in args
    assert yaml.safe_load(render.serving_yaml(knobs, "note"))["num_replicas"] == 2


def test_deploy_applies_serving_yaml_but_explicit_settings_win(tmp_path):
    from moeflow.serving.deployment import apply_serving, engine_settings
    from workflows.selection import absolutize as _absolutize

    tuned = tmp_path / "serving.yaml"
    tuned.write_text("# note\nmax_num_seqs: 64\nmax_num_batched_tokens: 256\nnum_replicas: 2\nmax_ongoing_requests: 128\n")
    raw = {"model": {"path": str(tmp_path)}, "deploy": {"max_num_batched_tokens": 1024, "port": 0}}
    cfg = _absolutize(validate(raw))  # the runner's round trip keeps which keys were set
    from moeflow.core.config import PipelineConfig
    cfg = PipelineConfig.model_validate(cfg.model_dump(mode="json", exclude_unset=True))
    out, sources = apply_serving(cfg, tuned)
    assert out.deploy.max_num_seqs == 64 and out.deploy.num_replicas == 2 and out.deploy.max_ongoing_requests == 128
    assert out.deploy.max_num_batched_tokens == 1024
    assert sources["max_num_batched_tokens"].startswith("deploy (explicit") and sources["max_num_seqs"] == "serving.yaml"
    knobs = engine_settings(validate(dict(raw, deploy={"serving_config": str(tuned)})))
    assert knobs["max_num_seqs"] == 64 and knobs["max_num_batched_tokens"] == 256
    tuned.write_text("max_num_seqs: lots\n")
    with pytest.raises(UserError, match="max_num_seqs"):
        apply_serving(cfg, tuned)
    tuned.write_text("max_num_seq: 3\n")
    with pytest.raises(UserError, match="unknown engine setting 'max_num_seq'"):
        apply_serving(cfg, tuned)


def test_a_run_waits_only_as_long_as_a_request_could_still_meet_the_slos():
    from moeflow.serving.tune import Driver

    prof = validate_profile(dict(_raw(), slo={"ttft_ms": 250, "tpot_ms": 60}))
    d = Driver(prof, models=["b", "m"], base="b", vocab=100, max_model_len=512, api_key=None)
    reqs = [Request(0, "m", [1], 30, "chat"), Request(1, "m", [1], 8, "document")]
    assert d.bound_s(reqs) == pytest.approx(0.25 + 0.06 * 29 + 0.3)
    e2el = validate_profile(dict(_raw(), slo={"e2el_ms": 1500}))
    assert Driver(e2el, models=["b", "m"], base="b", vocab=100, max_model_len=512, api_key=None).bound_s(reqs) == 1.8
    tpot = validate_profile(dict(_raw(), slo={"tpot_ms": 50}))
    assert Driver(tpot, models=["b", "m"], base="b", vocab=100, max_model_len=512, api_key=None).tail_s == 4.0


def test_image_share_sends_chat_requests_with_a_png():
    from moeflow.serving.loadgen import _body

    raw = _raw()
    raw["images"] = {"share": 1.0, "width": 16, "height": 16}
    reqs = generate(validate_profile(raw), models=["b", "m"], base="b", vocab=100, num_requests=3)
    assert all(r.image.startswith("data:image/png;base64,") for r in reqs)
    path, body = _body(reqs[0])
    parts = body["messages"][0]["content"]
    assert path == "/v1/chat/completions" and parts[0]["image_url"]["url"] == reqs[0].image
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == reqs[0].max_tokens
    assert _body(Request(0, "m", [5, 6], 3, "c"))[0] == "/v1/completions"


class _FakeDriver:
    """Stands in for tune.Driver: each run costs `cost` s of the budget; goodput from the knobs."""

    def __init__(self, profile, budget, cost):
        from moeflow.serving.tune import Driver

        self.profile, self.budget, self.cost, self.calls = profile, budget, cost, []
        self.tail_s = 1.0
        self.bound_s = Driver.bound_s.__get__(self)

    def run(self, c, rate, seconds, keep_samples=False, pool=False):
        self.budget.start -= self.cost  # the run took `cost` seconds
        self.calls.append((c.name, rate))
        good = 0.5 if c.knobs["max_num_seqs"] < 32 else 1.0  # the default admits half of a burst
        return {"request_goodput": 10 * good, "slo_attainment": good, "mean_e2el_ms": 100.0,
                "met": good >= 0.9, "rate": rate, "wall_s": self.cost, "tail_s": self.cost}


class _FakeHarness:
    def __init__(self):
        self.deleted = []

    def delete(self, c):
        self.deleted.append(c.name)


@pytest.mark.parametrize("budget_s, probed, second_runs", [(100.0, 3, True), (13.0, 2, False)])
def test_search_keeps_its_budget_when_deploying_took_most_of_it(budget_s, probed, second_runs):
    from moeflow.serving.tune import Budget, search

    prof = load_profile(DEMO)
    cands = [Candidate("default", {"max_num_seqs": 16, "num_replicas": 2}),
             Candidate("c1", {"max_num_seqs": 64, "num_replicas": 2}),
             Candidate("c2", {"max_num_seqs": 128, "num_replicas": 2})]
    budget = Budget(budget_s)
    driver, harness = _FakeDriver(prof, budget, cost=5.0), _FakeHarness()
    out = search(driver, harness, cands, budget, rate_points=0)
    assert sum(c.probe is not None for c in cands) == probed
    assert out.default.final and out.chosen.knobs["max_num_seqs"] >= 64
    runs_at_rate = [n for n, r in driver.calls if r == prof.arrivals.rate]
    if second_runs:  # the default and the best candidate measured again; the other dropped
        assert runs_at_rate.count("default") == 2 and len(harness.deleted) == 1
        assert "second runs" not in out.message
    else:  # two probes spent the budget: no third probe, no second runs, and the message says so
        assert runs_at_rate == ["default", "c1"] and cands[2].dropped.startswith("not probed")
        assert out.default.final["final_skipped"] == "budget" and "no budget for second runs" in out.message
        assert budget.left() >= 0


def test_rate_search_runs_only_what_the_budget_still_holds():
    from moeflow.serving.tune import Budget, _rate_search

    prof = load_profile(DEMO)  # bursts of 64: two of them at 24 req/s arrive 5.05 s apart (seed 0)
    budget = Budget(12.0)
    driver = _FakeDriver(prof, budget, cost=5.0)
    c = Candidate("c1", {"max_num_seqs": 64, "num_replicas": 2})
    c.final = {"met": True, "rate": 16.0, "request_goodput": 10.0, "slo_attainment": 1.0}
    driver.requests = lambda rate, seconds: generate(prof, models=["m"], vocab=100, rate=rate,
                                                      num_requests=128)
    _rate_search(driver, c, 16.0, 1.5, 2, 1.0, 5.0, budget)  # 5.05 s + 5 s drain + 3 s > 12 s: no run
    assert driver.calls == [] and c.max_rate is None
    budget.seconds = 100.0
    _rate_search(driver, c, 16.0, 1.5, 2, 1.0, 5.0, budget)
    assert [r for _, r in driver.calls] == [24.0, 36.0] and c.max_rate == 36.0


def test_replay_records_when_each_request_was_sent():
    """`Result.sent` places a request on the replay's clock: sent at its arrival offset, before
    its first token came back (a real HTTP server streaming SSE on 127.0.0.1)."""
    import asyncio
    import time

    from aiohttp import web

    from moeflow.serving.loadgen import replay

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.02)  # the server's "TTFT"
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 2}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            t0 = time.perf_counter()
            reqs = [Request(arrival_s=a, model="m", prompt=[1, 2], max_tokens=1, klass="c") for a in (0.0, 0.1)]
            results, _ = await replay(f"http://127.0.0.1:{port}", reqs)
            return t0, results
        finally:
            await runner.cleanup()

    t0, results = asyncio.run(run())
    assert all(r.ok for r in results), [r.error for r in results]
    first, second = (r.sent - t0 for r in results)
    assert 0 <= first < 0.05 and 0.1 <= second < 0.3  # each at its arrival offset
    assert all(r.ttft >= 0.02 for r in results)  # sent before its first token came back
