"""The paired gate and output agreement on hand-made results (no model: fast)."""

from __future__ import annotations

import math

import pytest

from moeflow.evaluation.baseline import Agreement, check_gain, compare
from moeflow.evaluation.paired import kl_topk, logprob_agreement, per_sample_delta
from moeflow.evaluation.report import diff_table, failure_summary, render_text
from moeflow.evaluation.ties import TIE_MARGIN, generation_agreement, top1_tie_aware


def _task(samples: list[dict], metrics: dict, kind_tol=(0.02, 2.0)) -> dict:
    return {"metrics": metrics, "samples": samples, "n": len(samples),
            "dataset": {"sha256": "d", "files": {"t.jsonl": "d"}, "type": "perplexity"},
            "tolerance": {"abs_tol": kind_tol[0], "k_stderr": kind_tol[1]}}


def _bpb_result(nll_bits: list[float], nbytes: list[int], tokens=None) -> dict:
    """A perplexity task whose sample i has nll_bits[i] bits over nbytes[i] bytes."""
    samples = [{"index": i, "loglik": -b * math.log(2), "n_tokens": 1, "bytes": n,
                **(tokens[i] if tokens else {})} for i, (b, n) in enumerate(zip(nll_bits, nbytes))]
    value = sum(nll_bits) / sum(nbytes)
    metric = {"bits_per_byte": {"value": value, "stderr": 0.5, "higher_is_better": False,
                                "gate": True}}
    return {"tasks": {"text": _task(samples, metric)}}


def test_paired_gate_catches_a_shift_the_unpaired_one_misses():
    # samples spread widely (large unpaired stderr); the candidate is uniformly worse
    ref = _bpb_result([10.0, 40.0, 20.0, 80.0, 30.0], [10] * 5)
    cand = _bpb_result([11.0, 41.0, 21.0, 81.0, 31.0], [10] * 5)
    row, = compare(ref, cand)
    assert row.rule == "paired" and row.failed
    assert row.delta == pytest.approx(0.1) and row.threshold == pytest.approx(0.02)
    assert "worse in samples 0, 1, 2, 3, 4" in row.note
    # without per-sample scores (a format-1 record) the old unpaired rule applies
    for s in ref["tasks"]["text"]["samples"] + cand["tasks"]["text"]["samples"]:
        del s["loglik"]
    row, = compare(ref, cand)
    assert row.rule == "unpaired" and not row.failed and row.threshold == pytest.approx(1.0)


def test_per_sample_delta_of_accuracy_and_bits_per_byte():
    ref = [{"index": i, "acc": a} for i, a in enumerate([1, 0, 1, 1])]
    cand = [{"index": i, "acc": a} for i, a in enumerate([1, 0, 0, 1])]
    mean, se, moved = per_sample_delta("acc", ref, cand)
    assert mean == -0.25 and moved == [2] and se == pytest.approx(0.25)
    assert per_sample_delta("acc", ref, cand[:3]) is None  # other records: not paired
    r, c = _bpb_result([3.0, 5.0], [4, 6]), _bpb_result([4.0, 5.0], [4, 6])
    mean, _, moved = per_sample_delta("bits_per_byte", r["tasks"]["text"]["samples"],
                                      c["tasks"]["text"]["samples"])
    assert mean == pytest.approx(0.1) and moved == [0]


def _tok(top: list[tuple[int, float]], target: float) -> dict:
    return {"token_logprobs": [target], "top_ids": [[i for i, _ in top]],
            "top_logprobs": [[lp for _, lp in top]]}


def test_logprob_agreement_exact_for_equal_outputs_and_kl_for_swapped_ones():
    p = [(1, math.log(0.7)), (2, math.log(0.2)), (3, math.log(0.05))]
    q = [(2, math.log(0.7)), (1, math.log(0.2)), (3, math.log(0.05))]
    same = logprob_agreement([_tok(p, p[0][1])], [_tok(p, p[0][1])])
    assert same["kl_mean"] == 0.0 and same["top1_agreement"] == 1.0 and same["changed"] == []
    moved = logprob_agreement([_tok(p, p[0][1])], [_tok(q, q[1][1])])
    expected = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)  # the rest matches
    assert moved["kl_mean"] == pytest.approx(expected) and moved["top1_agreement"] == 0.0
    assert moved["changed"] == [0]
    assert logprob_agreement([{"loglik": 0.0}], [{"loglik": 0.0}]) is None  # format 1


def test_greedy_agreement_counts_positions_and_names_samples():
    ref = [{"output_ids": [5, 6, 7]}, {"output_ids": [1, 2]}]
    cand = [{"output_ids": [5, 6, 7]}, {"output_ids": [1, 3, 4]}]
    out = generation_agreement(ref, cand, TIE_MARGIN)  # no step records: nothing excused
    assert out["token_agreement"] == pytest.approx(4 / 6) and out["changed"] == [1]


def test_agreement_rows_gate_or_report_and_the_table_names_rule_and_samples():
    p = [(1, math.log(0.7)), (2, math.log(0.2)), (3, math.log(0.05))]
    q = [(2, math.log(0.7)), (1, math.log(0.2)), (3, math.log(0.05))]
    ref = _bpb_result([3.0, 3.0], [4, 4], tokens=[_tok(p, p[0][1])] * 2)
    cand = _bpb_result([3.0, 3.0], [4, 4], tokens=[_tok(p, p[0][1]), _tok(q, p[0][1])])
    rows = compare(ref, cand, label="baseline 'b'", agreement=Agreement())
    failed = {r.metric: r for r in rows if r.failed}
    assert set(failed) == {"top1_agreement", "kl_mean"}
    assert failed["top1_agreement"].candidate == 0.5 and "differ: samples 1" in \
        failed["top1_agreement"].note
    text = render_text(diff_table(rows, "t"), width=250)
    assert "output agreement" in text and "FAIL" in text
    assert "rule output agreement" in failure_summary(rows, "baseline 'b'")
    # a meant change: reported, not gated
    rows = compare(ref, cand, agreement=Agreement(mode="report"))
    assert not any(r.failed for r in rows) and {r.verdict for r in rows} >= {"info"}


def test_check_gain_is_paired_too():
    base = _bpb_result([10.0, 40.0, 20.0], [10] * 3)
    better = _bpb_result([9.0, 39.0, 19.0], [10] * 3)
    rows = check_gain(base, better, ["text"])
    assert rows[0].verdict == "better" and rows[0].rule == "target gain"
    assert check_gain(base, base, ["text"])[0].failed  # nothing improved


def _gen(steps: list[int], tops: list[list[tuple[int, float]]]) -> dict:
    """A generation sample with per-step top-k records (no EOS: steps are the output)."""
    return {"output_ids": steps, "step_ids": steps,
            "step_top_ids": [[t for t, _ in top] for top in tops],
            "step_top_logprobs": [[lp for _, lp in top] for top in tops]}


def test_generation_is_judged_at_its_first_divergent_step():
    tie = [(5, math.log(0.401)), (6, math.log(0.399)), (7, math.log(0.1))]
    flipped = [(6, math.log(0.401)), (5, math.log(0.399)), (7, math.log(0.1))]
    sure = [(1, math.log(0.9)), (2, math.log(0.05))]
    ref = [_gen([1, 5, 8, 9], [sure, tie, sure, sure])]
    # the candidate takes the other side of a near tie and then goes its own way
    near = [_gen([1, 6, 3, 4], [sure, flipped, sure, sure])]
    out = generation_agreement(ref, near, TIE_MARGIN, kl=kl_topk)
    assert out["token_agreement"] == 1.0 and out["ties"] == [0] and out["changed"] == []
    assert len(out["kl"]) == 2  # steps 0 and 1 share a context; later ones do not
    # the same flip from a confident reference (log-odds 0.9 : 0.05) is a real change
    confident = [(5, math.log(0.9)), (6, math.log(0.05))]
    out = generation_agreement([_gen([1, 5, 8, 9], [sure, confident, sure, sure])], near,
                               TIE_MARGIN, kl=kl_topk)
    assert out["token_agreement"] == pytest.approx(1 / 4) and out["changed"] == [0]
    # a flip to a token outside the reference's top-k is weighed at its k-th log-prob
    far = [_gen([1, 9, 3, 4], [sure, [(9, math.log(0.401)), (5, math.log(0.399))], sure, sure])]
    assert generation_agreement(ref, far, TIE_MARGIN)["changed"] == [0]


def test_teacher_forced_top1_excuses_near_ties_only():
    tie = [(1, math.log(0.401)), (2, math.log(0.399)), (3, math.log(0.1))]
    flip = [(2, math.log(0.401)), (1, math.log(0.399)), (3, math.log(0.1))]
    out = logprob_agreement([_tok(tie, tie[0][1])], [_tok(flip, flip[1][1])])
    assert out["top1_agreement"] == 1.0 and out["ties"] == 1
    assert logprob_agreement([_tok(tie, tie[0][1])], [_tok(flip, flip[1][1])],
                             tie_margin=0.0)["top1_agreement"] == 0.0


def test_top1_tie_aware_on_logits():
    import torch

    ref = torch.tensor([[2.0, 1.999, 0.0], [3.0, 0.0, 0.0]])  # [N, V]
    cand = torch.tensor([[1.999, 2.0, 0.0], [0.0, 3.0, 0.0]])
    assert top1_tie_aware(ref, cand, TIE_MARGIN) == (1, 1, 2)  # the tie agrees, the swap not
    assert top1_tie_aware(ref, ref, TIE_MARGIN) == (2, 0, 2)
