"""The serving stage's search on a live Ray Serve (default suite): a short burst profile
against a deploy: default that admits one sequence at a time, so most of each burst queues
behind whole requests and misses the TTFT SLO; the searched setting admits the burst and
must win on goodput, measured in the same run. Candidates load with the operators stage's
experts kernel."""

from __future__ import annotations

import json

import pytest
import yaml

from moeflow.core.config import validate
from moeflow_testing.tiny import build_debug_model
from tasks.base import StageContext

pytestmark = pytest.mark.integration

PROFILE = {"name": "burst", "arrivals": {"process": "bursts", "rate": 6, "burst_size": 12},
           "mix": [{"name": "chat", "share": 1, "prompt_len": {"dist": "fixed", "value": 8},
                    "output_len": {"dist": "fixed", "value": 32}}],
           # one request at a time, the 12th of a burst waits for 11 others' 32 tokens (~1 s here
           # through HAProxy, more through the proxy): the default must miss a 400 ms TTFT
           "num_requests": 24, "slo": {"ttft_ms": 400, "tpot_ms": 1000, "percentile": 90}}
SPACE = {"max_num_seqs": [16], "max_num_batched_tokens": [256], "enable_chunked_prefill": [True],
         "long_prefill_token_threshold": [], "max_long_partial_prefills": [1], "num_replicas": [1],
         "max_ongoing_requests": [16]}


def test_search_beats_a_default_that_cannot_admit_the_burst(ray_local, tmp_path):
    from tasks.serving import run

    base = build_debug_model("qwen3_moe", tmp_path / "model")
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(PROFILE))
    cfg = validate({"model": {"path": str(base)}, "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"},
                    # the structural limit: one sequence, one request in flight per replica
                    "deploy": {"port": 0, "max_num_seqs": 1, "max_ongoing_requests": 1, "num_replicas": 1,
                               "max_num_batched_tokens": 256},
                    "serving": {"profile": str(tmp_path / "profile.yaml"), "budget_s": 20,
                                "max_candidates": 2, "rate_points": 0, "search": SPACE}})
    operators = {"experts_implementation": {"training": "grouped_mm", "serving": "eager"}}
    inputs = {"convert": {"output_dir": str(base)}, "finetune": {}, "regress": {"passed": True},
              "operators": operators}
    out = tmp_path / "serving"
    out.mkdir()
    record = run(StageContext(stage="serving", config=cfg, out_dir=out, inputs=inputs,
                              tracking_uri=cfg.tracking.uri))
    report = json.loads((out / "report.json").read_text())
    default, chosen = report["default"], report["chosen"]
    assert default["config"]["max_num_seqs"] == 1 and chosen["config"]["max_num_seqs"] == 16, report["message"]
    # the same requests in the same run: queued requests of the default miss the TTFT SLO
    assert chosen["goodput_rps"] > 1.5 * default["goodput_rps"], report["message"]
    assert chosen["slo_attainment"] > default["slo_attainment"]
    assert record["chosen"]["max_num_seqs"] == 16 and report["message"].startswith("chose c1")
    assert yaml.safe_load((out / "serving.yaml").read_text())["max_num_seqs"] == 16
    assert report["experts_implementation"] == "eager"  # the operators stage's serving kernel
    assert any(n.startswith("max_num_partial_prefills: a knob of neither") for n in report["notes"])
    assert "note: max_num_partial_prefills: a knob of neither" in (out / "table.txt").read_text()
    for c in report["candidates"]:  # one whole burst per run at least, every request answered
        assert c["probe"]["num_prompts"] % 12 == 0 and c["probe"]["failed"] == 0
    assert set(report["phases_s"]) == {"deployed", "warmed_up", "searched", "torn_down"}
