"""The gate on the shipped demo base: damage fails (naming rule and tasks), an unchanged
model reproduces its baseline exactly, a numerically tiny change passes; the same with an
adapter through the CLI, and a quantised checkpoint gated by the stage."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from moeflow.evaluation.baseline import Agreement, compare
from moeflow.evaluation.runners import evaluate
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite
from moeflow_testing.demo_base import ASSET
from tasks.base import StageContext
from tests.eval_assets import _train_adapter, rewrite_weights, run_regress_in_mlflow, scale_weights, scramble_layer

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
    # a damaged layer is no near tie: its greedy flips and its per-step KL both fail
    assert {("reverse_em", m) for m in ("greedy_token_agreement", "kl_mean")} <= \
        {(r.task, r.metric) for r in rows if r.failed}


def _near_tie(reference: dict, root: Path) -> tuple[Path, int, list[int]]:
    """A copy of the demo base that flips the reference's closest greedy call and nothing else.

    Finds the generation step whose top-2 log-probs are nearest, then scales the
    candidate token's lm_head row (float32) so its logit there gains twice that
    margin: the greedy token flips, every distribution moves by ~1e-3 nats at most.

    Returns:
        (the copy, the record's index, its context ids up to the flipped step)
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    samples = reference["tasks"]["reverse_em"]["samples"]
    margin, i, t = min((s["step_top_logprobs"][t][0] - s["step_top_logprobs"][t][1], i, t)
                       for i, s in enumerate(samples) for t in range(len(s["step_ids"])))
    assert margin < 0.01, f"the demo base has no near tie in its first {len(samples)} answers"
    b = samples[i]["step_top_ids"][t][1]
    tok = AutoTokenizer.from_pretrained(ASSET)
    ids = tok(samples[i]["prompt"], add_special_tokens=False).input_ids + samples[i]["step_ids"][:t]
    with torch.no_grad():
        logit_b = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32)(
            torch.tensor([ids])).logits[0, -1, b].item()
    factor = 1 + 2 * margin / logit_b

    def change(name, w):
        if name != "lm_head.weight":
            return None
        w = w.float().clone()
        w[b] *= factor
        return w
    return rewrite_weights(ASSET, root / "near-tie", change), i, ids


def _one_task_suite(root: Path, prompts: list[str]) -> Path:
    """reverse_em over these prompts only: a small suite where one flip weighs."""
    rows = [{"prompt": p, "target": "x"} for p in prompts]
    (root / "tie.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "tie", "version": 1, "tasks": [{
        "name": "reverse_em", "type": "generation", "file": "tie.jsonl", "match": "exact",
        "max_new_tokens": 6, "stop": ["\n"], "abs_tol": 0.05}]}
    (root / "tie.yaml").write_text(yaml.safe_dump(spec))
    return root / "tie.yaml"


def test_near_tie_flip_passes_the_gate(reference, tmp_path):
    cand_dir, i, _ = _near_tie(reference, tmp_path)
    samples = reference["tasks"]["reverse_em"]["samples"]
    other = next(s["prompt"] for k, s in enumerate(samples) if k != i)
    suite = load_suite(_one_task_suite(tmp_path, [samples[i]["prompt"], other]))
    ref, cand = evaluate(suite, ASSET)[0], evaluate(suite, cand_dir)[0]
    a, b = (r["tasks"]["reverse_em"]["samples"][0]["output_ids"] for r in (ref, cand))
    assert a != b  # greedy outputs diverge ...
    rows = {r.metric: r for r in compare(ref, cand, label="baseline 'b'", agreement=Agreement())}
    assert rows["kl_mean"].candidate < 1e-6 and "max per-step KL" in rows["kl_mean"].note
    assert float(rows["kl_mean"].note.split()[-1]) < 1e-6  # ... at a per-step KL below 1e-6
    # position by position this would be a regression (one flip in 2 short answers) ...
    positional = sum(x == y for x, y in zip(a, b)) + len(ref["tasks"]["reverse_em"]["samples"][1][
        "output_ids"])
    assert positional / (max(len(a), len(b)) + len(cand["tasks"]["reverse_em"]["samples"][1][
        "output_ids"])) < Agreement().min_token_agreement
    # ... the tie-aware gate passes it, and says why
    assert not any(r.failed for r in rows.values()), rows
    assert "1 near-tie flip(s) excused" in rows["greedy_token_agreement"].note
    # the same flip with no tie allowed fails: the margin is what excuses it
    strict = compare(ref, cand, agreement=Agreement(tie_margin=0.0))
    assert any(r.failed and r.metric == "greedy_token_agreement" for r in strict)


def test_calibrate_check_counts_the_same_near_tie_as_agreeing(reference, tmp_path):
    import torch

    from moeflow.quant.compare import compare_checkpoints

    cand_dir, _, ids = _near_tie(reference, tmp_path)
    sample = [{"input_ids": torch.tensor([ids])}]
    tied = compare_checkpoints(ASSET, cand_dir, sample)["final"]
    assert tied["top1_agreement"] == 1.0 and tied["top1_near_ties"] == 1
    strict = compare_checkpoints(ASSET, cand_dir, sample, tie_margin=0.0)["final"]
    assert strict["top1_agreement"] < 1.0


def test_scaled_adapter_fails_against_the_adapter():
    """The trained adapter with its LoRA B x1.5 (e.g. a wrong lora_alpha): a real change."""
    from safetensors.torch import load_file, save_file

    m = models()
    scaled = m["root"] / "scaled-adapter"
    if not scaled.exists():
        shutil.copytree(m["adapter"], scaled)
        weights = load_file(scaled / "adapter_model.safetensors")
        save_file({k: v * 1.5 if "lora_B" in k else v for k, v in weights.items()},
                  scaled / "adapter_model.safetensors")
    ref, cand = evaluate(load_suite(m["suite"]), m["base"], [str(m["adapter"]), str(scaled)])
    failed = {(r.task, r.metric) for r in compare(ref, cand, agreement=Agreement()) if r.failed}
    assert {("reverse_em", "greedy_token_agreement"), ("reverse_em", "kl_mean")} <= failed


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
