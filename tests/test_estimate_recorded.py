"""Every pipeline run records the dry run's estimate beside what each stage measured: MLflow
metrics `<stage>.est_seconds` / `<stage>.seconds` (and `pipeline.*`) on the parent run, the
terms in `estimate.json`, and `moeflow runs --compare` shows them side by side.

The stages are named convert and plan, so the estimator prices the demo model's convert and
plan, but run in a fraction of a second: what is tested is the recording, not the stages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from moeflow.core import tracking as T
from moeflow.core.config import load_config
from moeflow.parallel import estimate as E
from tasks.base import StageSpec
from workflows.dryrun import dry_run
from workflows.report import compare, compare_tables
from workflows.runner import run_pipeline

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def _convert(ctx):
    time.sleep(0.3)
    return {"output_dir": ctx.config.model.path}


def _plan(ctx):
    return {"degrees": 1}


STAGES = {"convert": StageSpec(name="convert", run=_convert, sections=("model", "convert")),
          "plan": StageSpec(name="plan", run=_plan, after=("convert",), sections=("model",))}


def _config(tmp_path: Path, model: Path):
    return load_config(REPO / "configs" / "demo.yaml", [
        f"model.path={model}", f"workdir={tmp_path / 'work'}", "stages.enabled=[convert,plan]",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])


def test_runs_record_estimate_and_measured_seconds_and_compare_shows_both(
        ray_local, tmp_path, monkeypatch):
    # the host factor pinned: the figures below must not depend on this host's load
    monkeypatch.setattr("workflows.dryrun.probe_host", lambda: E.ANCHOR_PROBE_S)
    cfg = _config(tmp_path, REPO / "assets" / "demo-base")
    a = run_pipeline(cfg, stages=STAGES, use_cache=False)
    b = run_pipeline(cfg, stages=STAGES, use_cache=False)
    assert a.ok and b.ok
    client = MlflowClient(a.tracking_uri)
    run = client.get_run(a.run_id)
    m = run.data.metrics
    cli_est, _ = dry_run(cfg)  # what `moeflow run --dry-run` says for the same config
    priced = {s.name: s for s in cli_est.stages}
    assert m["convert.est_seconds"] == pytest.approx(priced["convert"].seconds)
    assert m["plan.est_seconds"] > 0 and m["pipeline.est_seconds"] >= m["convert.est_seconds"]
    for name in ("convert", "plan"):
        assert m[f"{name}.seconds"] == pytest.approx(a.stages[name].seconds)
    assert 0.3 <= m["convert.seconds"] <= m["pipeline.seconds"]
    path = client.download_artifacts(a.run_id, "estimate.json", str(tmp_path))
    recorded = {s["stage"]: s for s in json.loads(Path(path).read_text())["stages"]}
    assert [t["what"] for t in recorded["convert"]["terms"]] == [t.what for t in priced["convert"].terms]
    assert recorded["plan"]["seconds"] == pytest.approx(m["plan.est_seconds"])

    info = compare(client, a.run_id, b.run_id)
    timing = {row[0]: row[1:] for row in info["timing"]}
    assert set(timing) == {"convert", "plan", "pipeline"}
    assert timing["convert"][:2] == [m["convert.est_seconds"], m["convert.seconds"]]
    assert all(v is not None for v in timing["plan"])
    from rich.console import Console

    console = Console(record=True, width=80, file=open("/dev/null", "w"))
    for table in compare_tables(info):
        console.print(table)
    text = console.export_text()
    ratio = m["convert.seconds"] / m["convert.est_seconds"]
    assert "estimated vs measured" in text and f"{ratio:.2f}" in text

    # no estimate possible (no config.json to price): a tag, and the run goes on without it
    bare = tmp_path / "bare"
    bare.mkdir()
    c = run_pipeline(_config(tmp_path, bare), stages=STAGES, use_cache=False)
    assert c.ok
    run = client.get_run(c.run_id)
    assert "config.json" in run.data.tags[T.ESTIMATE_ERROR]
    assert not [k for k in run.data.metrics if k.endswith(".est_seconds")]
    assert "convert.seconds" in run.data.metrics
