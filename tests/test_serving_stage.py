"""The `serving` stage on a live Ray Serve: candidates deployed for real and driven by a
traffic profile, serving.yaml + report + plots in MLflow, deploy applying serving.yaml
(an explicit deploy: key still wins), and `moeflow bench serve` against the endpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import mlflow
import pytest
import yaml

from moeflow.core.config import validate
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model
from tasks.base import StageContext

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.ci]

PROFILE = {"name": "t", "arrivals": {"process": "poisson", "rate": 6},
           "mix": [{"name": "chat", "share": 1, "prompt_len": {"dist": "uniform", "mean": 16, "range_ratio": 0.25},
                    "output_len": {"dist": "fixed", "value": 6}}],
           "adapters": {"popularity": "zipf"}, "num_requests": 30,
           "slo": {"ttft_ms": 20000, "tpot_ms": 5000, "percentile": 90}}
SPACE = {"max_num_seqs": [8], "max_num_batched_tokens": [128], "enable_chunked_prefill": [True],
         "long_prefill_token_threshold": [32], "max_long_partial_prefills": [1], "num_replicas": [1],
         "max_ongoing_requests": [16]}


def _config(tmp, uri, profile, **serving):
    return validate({"model": {"path": str(tmp / "model")}, "tracking": {"uri": uri},
                     "deploy": {"port": 0, "max_num_batched_tokens": 384},
                     "serving": dict({"profile": str(profile), "budget_s": 25, "max_candidates": 2,
                                      "rate_points": 1, "search": SPACE}, **serving)})


def _ctx(tmp, cfg, name, inputs):
    out = tmp / name
    out.mkdir()
    return StageContext(stage=name, config=cfg, out_dir=out, inputs=inputs, tracking_uri=cfg.tracking.uri)


@pytest.fixture(scope="module")
def tuned(ray_local, tmp_path_factory, mlflow_uri):
    """Run the serving stage inside an MLflow run."""
    from tasks.serving import run

    tmp = tmp_path_factory.mktemp("serving")
    base = build_debug_model("qwen3_moe", tmp / "model")
    inputs = {"convert": {"output_dir": str(base)},
              "finetune": {"adapter_dir": str(make_lora_adapter(base, tmp / "main", seed=1)), "adapter_name": "main",
                           "adapters": {"reverse": {"adapter_dir": str(make_lora_adapter(base, tmp / "rev", seed=2)),
                                                    "tenant": True}}},
              "regress": {"passed": True}}
    (tmp / "profile.yaml").write_text(yaml.safe_dump(PROFILE))
    cfg = _config(tmp, mlflow_uri, tmp / "profile.yaml")
    ctx = _ctx(tmp, cfg, "serving", inputs)
    mlflow.set_tracking_uri(mlflow_uri)
    with mlflow.start_run() as active:
        record = run(ctx)
    return {"record": record, "ctx": ctx, "run_id": active.info.run_id, "tmp": tmp, "inputs": inputs, "cfg": cfg}


def test_stage_writes_serving_yaml_report_and_mlflow(tuned):
    from ray import serve

    record, out = tuned["record"], tuned["ctx"].out_dir
    chosen = yaml.safe_load((out / "serving.yaml").read_text())
    assert chosen == record["chosen"] and set(chosen) >= {"max_num_seqs", "num_replicas", "max_ongoing_requests"}
    report = json.loads((out / "report.json").read_text())
    assert report["slo"]["ttft_ms"] == 20000 and report["slo"]["percentile"] == 90
    for side in ("default", "chosen"):
        assert {"config", "goodput_rps", "p99_ttft_ms", "p99_tpot_ms", "p99_e2el_ms"} <= set(report[side])
    assert report["default"]["config"]["max_num_batched_tokens"] == 384  # the deploy: settings
    names = [c["name"] for c in report["candidates"]]
    assert names == ["default", "c1"] and report["slo_met"] and record["slo_met"]
    for c in report["candidates"]:  # probed; the best and the default measured longer, at more rates
        assert c["probe"]["num_prompts"] >= 8 and c["goodput_rps"] > 0 and c["slo_attainment"] >= 0.9
        if c["name"] == "default" or not c["dropped"]:
            assert c["final"]["completed"] > 0 and c["final"]["num_prompts"] >= c["probe"]["num_prompts"]
            assert c["rates"] and c["max_rate_rps"] >= 6
        else:
            assert c["final"] is None and "probe goodput" in c["dropped"]
    assert record["goodput_rps"] > 0 and record["message"] in (out / "table.txt").read_text()
    assert "--max-num-seqs" in (out / "vllm_serve_args.txt").read_text()
    assert yaml.safe_load((out / "ray_serve_llm.yaml").read_text())["engine_kwargs"]["max_num_seqs"] == chosen["max_num_seqs"]
    client = mlflow.MlflowClient(tuned["cfg"].tracking.uri)
    arts = {a.path for a in client.list_artifacts(tuned["run_id"], "serving")}
    assert {"serving/serving.yaml", "serving/report.json", "serving/table.txt", "serving/goodput_vs_rate.png",
            "serving/latency_cdf.png", "serving/ray_serve_llm.yaml"} <= arts
    run = client.get_run(tuned["run_id"]).data
    assert run.params["chosen.max_num_seqs"] == str(chosen["max_num_seqs"]) and run.metrics["slo_met"] == 1.0
    # the candidates are gone, and the Serve this stage started is shut down (deploy picks its own port)
    from ray.serve.context import _get_global_client
    assert _get_global_client(raise_if_no_controller_running=False) is None
    del serve


def test_deploy_applies_serving_yaml_and_bench_serve_reads_it(tuned, tmp_path, ray_local):
    from ray import serve

    from tasks.deploy import run

    inputs = dict(tuned["inputs"], serving=tuned["record"])
    ctx = _ctx(tmp_path, tuned["cfg"], "deploy", inputs)
    with mlflow.start_run() as active:
        record = run(ctx)
    try:
        knobs = record["serving_yaml"]["knobs"]
        assert record["serving_yaml"]["path"] == tuned["record"]["serving_yaml"]
        assert knobs["max_num_seqs"] == "serving.yaml" and knobs["num_replicas"] == "serving.yaml"
        assert knobs["max_num_batched_tokens"].startswith("deploy (explicit")
        assert record["replicas"]["from"] == "serving.yaml"
        params = mlflow.MlflowClient(tuned["cfg"].tracking.uri).get_run(active.info.run_id).data.params
        assert "max_num_seqs" in params["knobs_from_serving_yaml"]
        assert params["knobs_kept_from_config"] == "max_num_batched_tokens"
        assert params["applied.max_num_batched_tokens"] == "384"
        assert params["applied.max_num_seqs"] == str(tuned["record"]["chosen"]["max_num_seqs"])
        proc = subprocess.run(
            [sys.executable, "-c", "from workflows.cli import main; main()", "bench", "serve", "--url", record["url"],
             "--model", "model", "--lora-modules", "main", "reverse", "--num-prompts", "12", "--request-rate", "20",
             "--random-input-len", "16", "--random-output-len", "6", "--goodput", "ttft:60000", "tpot:60000",
             "--metric-percentiles", "50,99"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert re.search(r"Successful requests: +12 ", proc.stdout), proc.stdout
        for label in ("Request throughput (req/s):",
                      "Output token throughput (tok/s):", "Request goodput (req/s):", "Mean TTFT (ms):",
                      "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 ITL (ms):", "P99 E2EL (ms):"):
            assert label in proc.stdout, proc.stdout
        bad = subprocess.run([sys.executable, "-c", "from workflows.cli import main; main()", "bench", "serve",
                              "--url", record["url"], "--model", "model", "--goodput", "latency:3"],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "ttft:MS" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        serve.shutdown()


def test_slo_nobody_meets_still_finishes_with_the_best_attainment(tuned, mlflow_uri):
    from tasks.serving import run

    tmp = tuned["tmp"]
    (tmp / "hard.yaml").write_text(yaml.safe_dump(dict(PROFILE, slo={"ttft_ms": 0.01, "percentile": 99})))
    cfg = _config(tmp, mlflow_uri, tmp / "hard.yaml", max_candidates=1, rate_points=0, budget_s=10)
    ctx = _ctx(tmp, cfg, "hard", tuned["inputs"])
    with mlflow.start_run() as active:
        record = run(ctx)
    assert not record["slo_met"] and record["message"].startswith("no candidate meets the SLOs")
    tags = mlflow.MlflowClient(mlflow_uri).get_run(active.info.run_id).data.tags
    assert tags["moeflow.serving.result"] == record["message"]
    assert (ctx.out_dir / "serving.yaml").is_file()
