"""MOEFLOW_STEP_LOG (moeflow/serving/step_log.py): the engine core logs each step's rows, tokens
and times where it is set, and nothing where it is not."""

from __future__ import annotations

from pathlib import Path

import torch

from moeflow.serving import step_log
from moeflow.serving.engine_core import EngineCore
from moeflow.serving.sampling import SamplingParams
from moeflow.serving.scheduler import EngineConfig

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo-base"


def _serve(prompts: list[list[int]], new: int) -> int:
    from moeflow.model.models import load_model

    core = EngineCore(load_model(str(DEMO), torch.float32).eval(), EngineConfig(max_num_seqs=4))
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=new, ignore_eos=True))
    steps = 0
    while core.iterate():
        steps += 1
    return steps


def test_each_step_is_logged_with_its_rows_and_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv(step_log.ENV, str(tmp_path / "steps"))
    steps = _serve([[5, 6, 7, 8, 9], [10, 11, 12]], new=4)
    rows = step_log.read(tmp_path / "steps")
    assert len(rows) == steps >= 4
    # the first step prefills both prompts (5 + 3 tokens) and samples their first tokens; then
    # one token a row a step
    assert (rows[0]["rows"], rows[0]["tokens"]) == (2, 8)
    assert all((r["rows"], r["tokens"]) == (2, 2) for r in rows[1:])
    assert all(r["step_ms"] > 0 and r["step_cpu_ms"] > 0 and r["emit_ms"] >= 0 for r in rows)
    assert [r["start_s"] for r in rows] == sorted(r["start_s"] for r in rows)


def test_nothing_is_written_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(step_log.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _serve([[5, 6, 7]], new=2)
    assert not list(tmp_path.iterdir())
