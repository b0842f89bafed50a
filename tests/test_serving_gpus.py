"""The serving stage places its candidate replicas as deploy would: on GPUs when the Ray
cluster has them (shared when the candidates outnumber them), on CPUs otherwise."""

from __future__ import annotations

import pytest
import ray

from moeflow.config import validate
from moeflow.errors import UserError
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
