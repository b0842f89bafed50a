"""lm-evaluation-harness tasks in a suite, run against the live Ray Serve endpoint.

The shipped lm-eval task (configs/suites/lmeval/next_letter_mc) holds the same
20 items as our own `next_letter` multiple-choice task, so lm-eval's
`local-completions` scoring through /v1/completions must agree with ours.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moeflow.core.errors import UserError
from moeflow.evaluation.baseline import compare
from moeflow.evaluation.endpoint import evaluate_endpoint
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite

pytestmark = pytest.mark.integration
SUITE = GOLDEN_SUITE.parent / "golden-lmeval.yaml"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from moeflow_testing.tiny import build_debug_model

    return build_debug_model("qwen3_moe", tmp_path_factory.mktemp("lmeval") / "base",
                             dtype="float32")


@pytest.fixture(scope="module")
def server(ray_local, base):
    from ray import serve

    from moeflow.serving.app import ServeSettings, free_port, start

    yield start(ServeSettings(base_dir=str(base), served_model_name="base"), port=free_port())
    serve.shutdown()


def test_lm_eval_task_via_endpoint_matches_our_scoring(server, base):
    suite = load_suite(SUITE)
    first = evaluate_endpoint(suite, server, "base", tokenizer=str(base))
    second = evaluate_endpoint(suite, server, "base", tokenizer=str(base))
    ours, theirs = first["tasks"]["next_letter"], first["tasks"]["next_letter_lmeval"]
    assert theirs["n"] == ours["n"] == 20
    acc = theirs["metrics"]["acc"]
    assert acc["gate"] and acc["stderr"] is not None and 0 <= acc["value"] <= 1
    assert not theirs["metrics"]["acc_norm"]["gate"]  # only the named metric gates
    # deterministic: bit-identical across two runs
    assert theirs["metrics"] == second["tasks"]["next_letter_lmeval"]["metrics"]
    # same items, same numbers: lm-eval's token-id requests vs our text requests
    for name in ("acc", "acc_norm"):
        assert theirs["metrics"][name]["value"] == pytest.approx(ours["metrics"][name]["value"])
        assert theirs["metrics"][name]["stderr"] == pytest.approx(ours["metrics"][name]["stderr"])
    by_doc = {s["index"]: s["logliks"] for s in theirs["samples"]}
    for row in ours["samples"]:
        assert by_doc[row["index"]] == pytest.approx(row["logliks"], abs=1e-4)
    # baselines and gates work unchanged, and the dataset hash covers the task files
    assert not any(r.failed for r in compare(first, second, label="run 1"))
    assert set(theirs["dataset"]["files"]) == {"lmeval/next_letter_mc/next_letter.jsonl",
                                               "lmeval/next_letter_mc/next_letter_mc.yaml"}


def test_in_process_runner_skips_lm_eval_with_a_note(base):
    from moeflow.evaluation.runners import evaluate

    result = evaluate(load_suite(SUITE), base)[0]
    assert "--endpoint" in result["tasks"]["next_letter_lmeval"]["skipped"]
    assert "acc" in result["tasks"]["next_letter"]["metrics"]


def test_lm_eval_bad_input_is_one_line(tmp_path, monkeypatch):
    server = "http://127.0.0.1:9"  # never reached: the inputs fail first
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\ntasks:\n  - {name: x, type: lm_eval, task: t}\n")
    with pytest.raises(UserError, match="needs task_dir"):
        load_suite(bad)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "data.jsonl").write_text("{}\n")
    bad.write_text("name: b\ntasks:\n  - {name: x, type: lm_eval, task: t, task_dir: t}\n")
    with pytest.raises(UserError, match="no task YAML"):
        load_suite(bad)
    only = tmp_path / "only.yaml"
    only.write_text("name: o\ntasks:\n  - {name: x, type: lm_eval, task: next_letter_mc, "
                    f"task_dir: {SUITE.parent / 'lmeval' / 'next_letter_mc'}}}\n")
    suite = load_suite(only)
    with pytest.raises(UserError, match="tokenizer dir"):
        evaluate_endpoint(suite, server, "base")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if the extra were not installed
    with pytest.raises(UserError, match=r"pip install moeflow\[lmeval\]"):
        evaluate_endpoint(suite, server, "base", tokenizer=str(tmp_path))
