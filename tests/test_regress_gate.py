"""The gate on the shipped demo base: damage fails (naming rule and tasks), an unchanged
model reproduces its baseline exactly, a numerically tiny change passes; the same with an
adapter through the CLI, and a quantised checkpoint gated by the stage."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moeflow.config import validate
from moeflow.demo_base import ASSET
from moeflow.errors import UserError
from moeflow.evaluation.baseline import Agreement, compare
from moeflow.evaluation.runners import evaluate
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite
from tasks.base import StageContext
from tests.eval_assets import (_train_adapter, rewrite_weights, run_regress_in_mlflow,
                               scale_weights, scramble_layer)

pytestmark = pytest.mark.usefixtures("one_thread")
TASKS = ("reverse_nll", "reverse_em", "next_letter", "demo_text")


@functools.lru_cache(maxsize=None)
def models() -> dict[str, Path]:
    """A small golden suite, copies of the demo base (scaled, scrambled, noisy) and an adapter."""
    import torch

    root = Path(tempfile.mkdtemp(prefix="mf-gate-"))
    golden = yaml.safe_load(GOLDEN_SUITE.read_text())
    golden["tasks"] = [dict(t, file=str(GOLDEN_SUITE.parent / t["file"]), limit=8)
                       for t in golden["tasks"] if t["name"] in TASKS]
    suite = root / "small.yaml"
    suite.write_text(yaml.safe_dump(golden))
    gen = torch.Generator().manual_seed(1)
    return {"root": root, "suite": suite, "base": ASSET,
            "scaled": scale_weights(ASSET, root / "scaled"),
            "scrambled": scramble_layer(ASSET, root / "scrambled"),
            # a stand-in for a quantised copy: every 2-D weight off by ~0.5% noise
            "noisy": rewrite_weights(ASSET, root / "noisy", lambda _n, w: w * (
                1 + 0.005 * torch.randn(w.shape, generator=gen)) if w.dim() == 2 else None),
            "adapter": _train_adapter(ASSET, root / "adapter", steps=5)}


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    if models.cache_info().currsize:
        shutil.rmtree(models()["root"], ignore_errors=True)


@pytest.fixture(scope="module")
def reference():
    return evaluate(load_suite(models()["suite"]), models()["base"])[0]


def _gate(reference: dict, name: str) -> list:
    cand = evaluate(load_suite(models()["suite"]), models()[name])[0]
    return compare(reference, cand, label="baseline 'b'", agreement=Agreement())


def test_unchanged_model_reproduces_its_baseline_exactly(reference):
    rows = _gate(reference, "base")
    gated = [r for r in rows if r.verdict not in ("info", "skipped")]
    assert gated and not any(r.failed for r in rows)
    assert all(r.delta == 0 for r in gated), [(r.task, r.metric, r.delta) for r in gated]
    agree = [r for r in gated if r.rule == "output agreement"]
    assert {r.task for r in agree} == set(TASKS)
    assert all(r.candidate == (0.0 if r.metric == "kl_mean" else 1.0) and "differ" not in r.note
               for r in agree)


def test_tiny_perturbation_passes(reference):
    rows = _gate(reference, "scaled")
    assert not any(r.failed for r in rows), [r for r in rows if r.failed]


def test_scrambled_layer_fails_naming_rule_and_tasks(reference):
    rows = _gate(reference, "scrambled")
    failed = {(r.task, r.rule) for r in rows if r.failed}
    assert ("demo_text", "paired") in failed  # the learned language is damaged
    assert {(t, "output agreement") for t in TASKS} <= failed


def test_cli_adapter_against_its_recorded_baseline(mlflow_uri):
    from workflows.cli import app
    from workflows.commands import register_all

    register_all(app)
    m = models()
    common = ["--suite", str(m["suite"]), "--tracking-uri", mlflow_uri, "--adapter",
              str(m["adapter"])]
    runner = CliRunner()
    out = runner.invoke(app, ["regress", "--model", str(m["base"]), "--record-baseline", "ad",
                              *common])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["regress", "--model", str(m["scaled"]), "--baseline", "ad", *common])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["regress", "--model", str(m["scrambled"]), "--baseline", "ad",
                              *common])
    assert out.exit_code == 1, out.output
    assert "rule output agreement" in out.output and "rule paired" in out.output
    assert "demo_text/kl_mean" in out.output and "reverse_em/greedy_token_agreement" in out.output


def _stage_ctx(tmp_path: Path, uri: str, checkpoint: Path) -> StageContext:
    m = models()
    cfg = validate({"name": "gate", "experiment": "gate", "workdir": str(tmp_path / "w"),
                    "model": {"path": str(m["base"]), "dtype": "float32"},
                    "tracking": {"uri": uri},
                    "regress": {"shards": 1, "suite": str(m["suite"]), "compare_base": False}})
    (tmp_path / "out").mkdir(parents=True)
    return StageContext(stage="regress", config=cfg, out_dir=tmp_path / "out", tracking_uri=uri,
                        inputs={"convert": {"output_dir": str(m["base"]), "manifest_sha256": "m"},
                                "finetune": {"adapter_dir": str(m["adapter"])},
                                "calibrate": {"checkpoint": str(checkpoint), "scheme": "fp8"}})


def test_stage_gates_a_calibrated_checkpoint_against_the_base(tmp_path, mlflow_uri):
    result, run_id = run_regress_in_mlflow(mlflow_uri, "gate",
                                           _stage_ctx(tmp_path / "a", mlflow_uri,
                                                      models()["noisy"]))
    assert isinstance(result, dict), result
    assert "calibrated" in result["gated"]
    table = (tmp_path / "a" / "out" / "comparison.txt").read_text()
    assert "calibrated vs base" in table and "kl_mean" in table
    assert result["probe"]["ppl_ratio"] <= 0.5 and result["probe"]["max_load_skew"] >= 1.5
    err, _ = run_regress_in_mlflow(mlflow_uri, "gate",
                                   _stage_ctx(tmp_path / "b", mlflow_uri, models()["scrambled"]))
    assert isinstance(err, UserError) and "calibrated vs base" in str(err)
    assert "rule output agreement" in str(err)
