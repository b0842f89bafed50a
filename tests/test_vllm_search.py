"""The serving stage with deploy.backend vllm: two vLLM candidates (a tiny head_dim-32 Qwen3-MoE
on vLLM's CPU build) brought up one at a time through the vllm backend, measured on the same
traffic as the local search, the winner written to serving.yaml in deploy: names and rendered
as vLLM arguments. Needs `make setup-vllm` (skips naming it without); slow: two vLLM engines
start on CPU."""

from __future__ import annotations

import json

import pytest
import yaml

from moeflow.core.config import validate
from moeflow.parallel.vllm_plan import single_device_plan
from moeflow.serving import vllm_backend as V
from moeflow.serving import vllm_run
from tasks.base import StageContext

PROFILE = {"name": "small", "arrivals": {"process": "poisson", "rate": 2},
           "mix": [{"name": "chat", "share": 1, "prompt_len": {"dist": "fixed", "value": 8},
                    "output_len": {"dist": "fixed", "value": 8}}],
           "num_requests": 8, "slo": {"ttft_ms": 20000, "tpot_ms": 5000, "percentile": 90}}
SPACE = {"max_num_seqs": [4], "max_num_batched_tokens": [256], "enable_chunked_prefill": [True],
         "long_prefill_token_threshold": [], "max_long_partial_prefills": [1], "num_replicas": [1],
         "max_ongoing_requests": [8]}


@pytest.mark.slow  # two vLLM engines start on CPU, one after the other: minutes on a busy host
@pytest.mark.timeout(1800)
@pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))
def test_vllm_candidates_are_searched_one_at_a_time(ray_local, tmp_path, monkeypatch):
    from moeflow_testing.tiny import build_debug_model
    from tasks.serving import run

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a shared CPU host
    real_kwargs = V.engine_kwargs
    started: list[dict] = []

    def eager(*args, **kw):  # no torch.compile: each engine starts faster (the test's only change)
        out = dict(real_kwargs(*args, **kw), enforce_eager=True)
        started.append(out)
        return out

    monkeypatch.setattr(V, "engine_kwargs", eager)
    base = build_debug_model("qwen3_moe", tmp_path / "tiny-moe", head_dim=32, dtype="float32")
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(PROFILE))
    cfg = validate({"model": {"path": str(base), "dtype": "float32"},
                    "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"},
                    "deploy": {"backend": "vllm", "dtype": "float32", "max_model_len": 256, "port": 0,
                               "max_num_seqs": 1, "max_ongoing_requests": 8, "max_num_batched_tokens": 256},
                    "serving": {"profile": str(tmp_path / "profile.yaml"), "budget_s": 60,
                                "max_candidates": 2, "rate_points": 0, "search": SPACE}})
    out = tmp_path / "serving"
    out.mkdir()
    inputs = {"convert": {"output_dir": str(base)}, "finetune": {}, "regress": {"passed": True},
              "plan": {"plan": {"serving": {"vllm": single_device_plan(), "backend": "vllm"}}}}
    record = run(StageContext(stage="serving", config=cfg, out_dir=out, inputs=inputs,
                              tracking_uri=cfg.tracking.uri))
    report = json.loads((out / "report.json").read_text())
    assert report["backend"] == "vllm" and report["experts_implementation"] == "vllm"
    # each candidate came up through the vllm backend with its own engine settings, and was measured
    assert [kw["max_num_seqs"] for kw in started] == [1, 4]
    for c in report["candidates"]:
        assert c["final"]["num_prompts"] >= 8 and c["final"]["failed"] == 0, c
    assert any(n.startswith("vLLM candidates on cpu, started one at a time") for n in report["notes"])
    chosen = yaml.safe_load((out / "serving.yaml").read_text())
    assert chosen["max_num_seqs"] == record["chosen"]["max_num_seqs"] in (1, 4)
    args = (out / "vllm_serve_args.txt").read_text()
    assert f"--max-num-seqs {chosen['max_num_seqs']}" in args and "partial-prefills" not in args


class _Harness:
    """Stands in for VllmHarness: records the order candidates go up and down."""

    def __init__(self, start_s: float, clock: list[float]):
        self.start_s, self.clock, self.events, self.up_s, self.live = start_s, clock, [], [], None

    def up(self, c, index):
        assert self.live is None, "a candidate went up while another was live"
        self.live, c.url = c, f"http://x/{index}"
        self.clock[0] += self.start_s  # starting an engine costs its seconds of the budget
        self.up_s.append(self.start_s)
        self.events.append(("up", c.name))

    def down(self):
        self.events.append(("down", self.live.name))
        self.live = None

    def served_models(self, c, api_key):
        return ["m"]


class _Driver:
    def __init__(self, goodput: dict[str, float]):
        from types import SimpleNamespace

        self.goodput, self.tail_s = goodput, 0.5
        self.profile = SimpleNamespace(arrivals=SimpleNamespace(rate=2.0, group=lambda: 1),
                                       slo=SimpleNamespace(limits=lambda: {"ttft": 1000.0}, percentile=90.0))

    def run(self, c, rate, seconds, keep_samples=False, pool=False):
        g = self.goodput[c.name]
        return {"request_goodput": g, "slo_attainment": g / 2, "met": g >= 1.0, "rate": rate, "tail_s": 0.5,
                "wall_s": seconds, "mean_e2el_ms": 100.0}


def test_one_candidate_up_at_a_time_and_the_budget_drops_the_rest(monkeypatch):
    """The search logic without vLLM: up, measured, down, in order; a candidate the budget cannot
    hold any more is not started (the default and one other always are); the best goodput wins."""
    from moeflow.serving import vllm_search
    from moeflow.serving.tune import Budget, Candidate

    clock = [0.0]
    monkeypatch.setattr(vllm_search, "warm_up", lambda driver, cands: None)
    budget = Budget(100.0)
    monkeypatch.setattr(Budget, "left", lambda self: self.seconds - clock[0])
    harness = _Harness(start_s=40.0, clock=clock)
    cands = [Candidate(n, {"max_num_seqs": s, "num_replicas": 1}) for n, s in (("default", 1), ("c1", 4), ("c2", 8))]
    outcome, _ = vllm_search.search_one_at_a_time(lambda models: _Driver({"default": 0.5, "c1": 1.5, "c2": 9.0}),
                                                  harness, cands, budget, rate_points=0)
    assert harness.events == [("up", "default"), ("down", "default"), ("up", "c1"), ("down", "c1")]
    assert cands[2].dropped.startswith("not measured") and cands[2].final is None
    assert outcome.chosen is cands[1] and outcome.slo_met and "one at a time (40, 40 s to start)" in outcome.message
