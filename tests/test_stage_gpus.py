"""Stages take their devices from the Ray cluster: the stages that compute in their own task
(operators, in-process regress and calibrate) ask for a GPU when the cluster has one; the serving stage places
its candidate replicas as deploy would (shared when they outnumber the GPUs); CPUs otherwise."""

from __future__ import annotations

import pytest
import ray

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from moeflow.serving.tune import Candidate
from tasks.serving import _replica_gpus


def _cands(*replicas: int) -> list[Candidate]:
    return [Candidate(f"c{i}", {"num_replicas": n}) for i, n in enumerate(replicas)]


def _cluster(monkeypatch, total: float, free: float) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": total} if total else {"CPU": 16.0})
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 8.0, "GPU": free} if total else {"CPU": 8.0})


def _cfg(**deploy):
    return validate({"model": {"path": "m"}, "deploy": deploy})


def test_no_gpus_in_the_cluster_tunes_on_cpus(monkeypatch):
    _cluster(monkeypatch, 0, 0)
    assert _replica_gpus(_cfg(), _cands(1, 1, 2)) == 0.0


def test_one_gpu_each_when_there_are_enough(monkeypatch):
    _cluster(monkeypatch, 8, 8)
    assert _replica_gpus(_cfg(), _cands(1, 2, 1)) == 1.0
    assert _replica_gpus(_cfg(num_gpus=0.5), _cands(1, 2, 1)) == 0.5


def test_candidates_share_the_free_gpus_when_they_outnumber_them(monkeypatch):
    _cluster(monkeypatch, 1, 1)
    assert _replica_gpus(_cfg(), _cands(1, 1, 1)) == 0.33  # three replicas on one GPU, one driven at a time


def test_explicit_zero_gpus_stays_on_cpus(monkeypatch):
    _cluster(monkeypatch, 8, 8)
    assert _replica_gpus(_cfg(num_gpus=0), _cands(1, 1)) == 0.0


def test_no_free_gpu_is_one_line_naming_the_knobs(monkeypatch):
    _cluster(monkeypatch, 2, 0)
    with pytest.raises(UserError, match="deploy.num_gpus"):
        _replica_gpus(_cfg(), _cands(1, 1))


def test_stages_that_compute_in_their_task_ask_for_a_gpu_only_where_there_is_one(monkeypatch):
    from tasks.calibrate import STAGE as calibrate
    from tasks.operators import STAGE as operators
    from tasks.regress import STAGE as regress

    cfg = validate({"model": {"path": "m"}, "regress": {"shards": 1}, "calibrate": {"shards": 1}})
    sharded = validate({"model": {"path": "m"}, "regress": {"shards": 4}, "calibrate": {"shards": 2}})
    _cluster(monkeypatch, 8, 8)
    assert operators.num_gpus(cfg) == regress.num_gpus(cfg) == calibrate.num_gpus(cfg) == 1.0
    # sharded: its shards take the GPUs; the stage holds none
    assert regress.num_gpus(sharded) == calibrate.num_gpus(sharded) == 0.0
    _cluster(monkeypatch, 0, 0)
    assert operators.num_gpus(cfg) == regress.num_gpus(cfg) == calibrate.num_gpus(cfg) == 0.0


def test_profile_shards_on_a_gpu_stage_with_no_gpu_free_run_in_its_task(monkeypatch):
    """Ray frees only the CPUs of a task blocked in ray.get: GPU shards waiting for the stage's
    own GPU would wait forever, so the profile runs in the stage's process instead."""
    from moeflow.operators import profile as P

    calls = []
    monkeypatch.setattr(P, "profile_local", lambda model_dir, texts, *a: calls.append(len(texts)) or
                        {"counts": [[1]], "layers": [0], "routers": ["r"], "tokens": len(texts)})
    _cluster(monkeypatch, 1, 0)
    out = P.profile("m", ["t"] * 10, shard_size=3, device="cuda")
    assert calls == [10] and out["shards"] == 1
