"""The runner on a real local Ray and a real MLflow store (sqlite in tmp).

Stages are the small real ones in tests/pipeline_stages.py: a -> b -> c, a -> d.
"""

import pytest
from mlflow.tracking import MlflowClient

from moeflow.core import tracking as T
from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tests.conftest import abcd_config
from workflows.report import pipeline_status
from workflows.runner import run_pipeline

pytestmark = pytest.mark.integration


def _run(raw, **kw):
    return run_pipeline(validate(raw), stages={}, **kw)


def _children(uri, parent_id):
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    return client, parent, T.child_runs(client, parent)


def test_full_run_layout_and_concurrency(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    out = _run(raw)
    assert out.ok, out.stages
    assert {n: s.state for n, s in out.stages.items()} == dict.fromkeys("abcd", "done")
    assert out.stages["c"].result == {"value": 20}
    client, parent, children = _children(out.tracking_uri, out.run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags[T.KIND] == "pipeline"
    assert parent.info.run_name == "abcd"
    assert sorted(r.data.tags[T.STAGE] for r in children) == ["a", "b", "c", "d"]
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.tags[T.PARENT] == out.run_id and run.data.tags[T.ATTEMPT] == "1"
        assert "result.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    b = next(r for r in children if r.data.tags[T.STAGE] == "b")
    assert b.data.params["optimizer.lr"] == "0.05" and b.data.params["data.seq_len"] == "2048"


def test_independent_stages_run_concurrently(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["a", "p", "q"]  # p and q each wait for the other to start
    out = _run(raw, use_cache=False)
    assert out.ok, {n: s.error for n, s in out.stages.items()}
    assert out.stages["p"].result == {"met": "q"} and out.stages["q"].result == {"met": "p"}


def test_failure_skips_downstream_then_resume_reruns_only_failed(ray_local, tmp_path):
    raw = abcd_config(tmp_path, lines="good\nbad\n")
    out = _run(raw, use_cache=False)
    assert out.status == "FAILED"
    states = {n: s.state for n, s in out.stages.items()}
    assert states == {"a": "done", "b": "failed", "c": "skipped", "d": "done"}
    assert "train.jsonl:2: bad line" in out.stages["b"].error
    client, parent, children = _children(out.tracking_uri, out.run_id)
    assert parent.info.status == "FAILED"
    failed = next(r for r in children if r.data.tags[T.STAGE] == "b")
    assert failed.info.status == "FAILED" and "bad line" in failed.data.tags[T.ERROR]
    first_ids = {r.data.tags[T.STAGE]: r.info.run_id for r in children}

    (tmp_path / "train.jsonl").write_text("good\n")  # fix the cause
    again = _run(raw, resume_run_id=out.run_id, use_cache=False)
    assert again.ok and again.run_id == out.run_id
    states = {n: s.state for n, s in again.stages.items()}
    assert states == {"a": "reused", "b": "done", "c": "done", "d": "reused"}
    client, parent, children = _children(out.tracking_uri, out.run_id)
    assert parent.info.status == "FINISHED"
    by_stage = {}
    for r in children:
        by_stage.setdefault(r.data.tags[T.STAGE], []).append(r)
    assert [r.info.run_id for r in by_stage["a"]] == [first_ids["a"]], "a was not re-executed"
    assert [r.info.run_id for r in by_stage["d"]] == [first_ids["d"]]
    assert [r.data.tags[T.ATTEMPT] for r in by_stage["b"]] == ["1", "2"]
    assert len(by_stage["c"]) == 1
    status = pipeline_status(client, out.run_id)
    assert status["status"] == "FINISHED"
    assert {s["name"]: (s["state"], s["attempts"]) for s in status["stages"]} == {
        "a": ("reused", 1), "b": ("done", 2), "c": ("done", 1), "d": ("reused", 1)}


def test_changed_config_reruns_only_that_stage_and_downstream(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    first = _run(raw, use_cache=False)
    assert first.ok
    raw["lora"] = {"rank": 32}  # only c reads lora
    again = _run(raw, resume_run_id=first.run_id, use_cache=False)
    assert {n: s.state for n, s in again.stages.items()} == {
        "a": "reused", "b": "reused", "c": "done", "d": "reused"}
    # a fresh run reuses every cached stage across runs; --rerun forces one and its downstream
    cached = _run(raw)
    assert all(s.state == "reused" for s in cached.stages.values())
    raw["stages"]["enabled"] = ["a", "b", "c", "d", "live"]  # live: never reused
    live = _run(raw)
    assert {n: s.state for n, s in live.stages.items()} == {
        "a": "reused", "b": "reused", "c": "reused", "d": "reused", "live": "done"}
    raw["stages"]["enabled"] = ["a", "b", "c", "d"]
    forced = _run(raw, rerun=["b"])
    assert {n: s.state for n, s in forced.stages.items()} == {
        "a": "reused", "b": "done", "c": "done", "d": "reused"}


def test_only_and_from_need_cached_upstream(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    with pytest.raises(UserError, match="stage a has no reusable result"):
        _run(raw, only=["b"])
    assert _run(raw).ok
    only = _run(raw, only=["c"])
    assert {n: s.state for n, s in only.stages.items()} == {"a": "reused", "b": "reused", "c": "done"}
    frm = _run(raw, from_=["b"])
    assert {n: s.state for n, s in frm.stages.items()} == {
        "a": "reused", "b": "done", "c": "done", "d": "reused"}


def test_a_stage_decides_its_gpus_from_the_config_when_submitted(ray_local, tmp_path):
    """StageSpec.num_gpus may be a function of the config (operators, regress: a GPU when the
    cluster has one); the runner evaluates it before asking Ray, and stages.resources still wins."""
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["gpu_by_config"]
    out = _run(raw, use_cache=False)  # default seed: the function asks for no GPU
    assert out.ok, out.stages["gpu_by_config"].error
    assert out.stages["gpu_by_config"].result == {"gpus": 0.0}
    raw["seed"] = 7  # the function would ask for a GPU this CPU cluster does not have
    raw["stages"]["resources"] = {"gpu_by_config": {"num_gpus": 0}}  # the override wins
    raw["workdir"] = str(tmp_path / "work2")
    assert _run(raw, use_cache=False).ok


def test_lost_worker_is_retried_by_ray(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["crashy"]
    out = _run(raw, use_cache=False)
    assert out.ok, out.stages["crashy"].error
    assert out.stages["crashy"].result == {"attempts_seen": 2}
    raw["stages"]["resources"] = {"crashy": {"max_retries": 0}}
    raw["workdir"] = str(tmp_path / "work2")
    out = _run(raw, use_cache=False)
    assert out.status == "FAILED" and out.stages["crashy"].state == "failed"
    client, _, children = _children(out.tracking_uri, out.run_id)
    assert children[0].info.status == "FAILED", "a dead worker's run is closed by the driver"


def test_resumable_stage_continues_its_partial_output_and_parent_gets_headlines(ray_local, tmp_path):
    raw = abcd_config(tmp_path)
    raw["stages"]["enabled"] = ["a", "partial"]
    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "work" / "fail-once").write_text("")
    first = _run(raw, use_cache=False)
    assert first.stages["partial"].state == "failed"
    out_dir = first.stages["partial"].out_dir
    notes = []
    second = _run(raw, resume_run_id=first.run_id,
                  on_event=lambda kind, st: notes.append(st.note) if kind == "note" else None)
    assert second.ok and second.run_id == first.run_id
    part = second.stages["partial"]
    assert part.out_dir == out_dir and part.result["kept"] == 1, part
    assert any(n.startswith("continuing the partial output") for n in notes), notes
    assert "kept 1 piece(s) of an earlier attempt" in notes

    client = MlflowClient(second.tracking_uri)
    metrics = client.get_run(second.run_id).data.metrics
    assert metrics["partial.kept"] == 1 and metrics["partial.ok"] == 1.0  # the explicit headline
    assert "partial.label" not in metrics and "a.value" in metrics  # default: numeric values
    exp = client.get_experiment(client.get_run(second.run_id).info.experiment_id)
    assert exp.tags[T.EXPERIMENT_KIND] == T.MODEL_TRAINING

    third = _run(raw)  # a new pipeline run that reuses both stages
    assert {s.state for s in third.stages.values()} == {"reused"}
    parent = client.get_run(third.run_id)
    assert parent.data.tags[T.REUSED_PREFIX + "partial"] == part.run_id
    assert parent.data.metrics["partial.kept"] == 1  # reused stages' headlines too
    import json

    table = json.loads(T.download_text(client, third.run_id, "stages.json"))
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    row = next(r for r in rows if r["stage"] == "partial")
    assert row["state"] == "reused" and row["run_id"] == part.run_id
    assert row["pipeline_run"] == first.run_id

    # the two pipelines side by side, as `moeflow runs --compare A B` prints them
    from workflows.report import compare

    info = compare(client, second.run_id, third.run_id)
    kept = next(m for m in info["metrics"] if m[0] == "partial.kept")
    assert kept == ["partial.kept", 1.0, 1.0, 0.0]
    assert ["partial", "done", "reused"] in info["stages"]
    import subprocess
    import sys

    from tests.conftest import cli_env

    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "runs", "--compare", second.run_id,
                           third.run_id, "--tracking-uri", second.tracking_uri], cwd=tmp_path,
                          env=cli_env(tmp_path, COLUMNS="80"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "partial.kept" in proc.stdout and second.run_id in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "workflows.cli", "runs", "--compare", second.run_id,
                          "--tracking-uri", second.tracking_uri], cwd=tmp_path, env=cli_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "two pipeline run ids" in bad.stderr


def test_headline_metrics_are_the_same_set_fresh_or_read_back_from_result_json():
    """Over HEADLINE_LIMIT numbers: a reused stage's record (result.json, keys sorted) gives the
    parent run the same metrics as the fresh stage did, so `runs --compare` misses none."""
    import json

    from workflows.outcome import HEADLINE_LIMIT, headline

    fresh = {f"m{i:02d}": float(i) for i in reversed(range(HEADLINE_LIMIT + 10))}  # not in name order
    stored = json.loads(json.dumps(fresh, sort_keys=True))
    assert headline(fresh) == headline(stored) and len(headline(fresh)) == HEADLINE_LIMIT
