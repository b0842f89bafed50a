"""Unit tests of evaluation suites, scoring and the regression gate (no model)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from moeflow.core.errors import UserError
from moeflow.evaluation.baseline import check_gain, compare
from moeflow.evaluation.record import assemble
from moeflow.evaluation.report import diff_table, failure_summary, render_text
from moeflow.evaluation.scoring import mean_stderr, ratio_stderr, score_task, truncate
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite

GOLDEN_DIR = GOLDEN_SUITE.parent


def write_suite(tmp_path: Path, tasks: list[dict], files: dict[str, list | str],
                **top) -> Path:
    """A suite YAML + its JSONL files under tmp_path."""
    import yaml

    for name, rows in files.items():
        text = rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows)
        (tmp_path / name).write_text(text)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "tasks": tasks, **top}))
    return path


MC = [{"context": "a", "choices": [" x", " yy"], "gold": 0},
      {"context": "b", "choices": [" x", " yy"], "gold": 1}]


def test_golden_suite_loads_with_hashes_and_every_task_type():
    suite = load_suite()
    kinds = {t.spec.type for t in suite.tasks}
    assert kinds == {"multiple_choice", "generation", "perplexity", "multimodal"}
    assert suite.spec.target_tasks == ["reverse_nll"]
    image_task = suite.task("image_colors")
    # the JSONL and every image it names are hashed
    assert len(image_task.files) == 1 + len({r["image_path"] for r in image_task.records})
    assert all(len(h) == 64 for h in image_task.files.values())
    # the demo task's held-out set, in the demo's own format
    first = suite.task("reverse_nll").records[0]
    assert first["prompt"].startswith("reverse: ") and first["completion"].startswith(" ")
    assert load_suite(GOLDEN_SUITE).sha256 == suite.sha256


def test_dataset_hash_changes_with_one_image(tmp_path):
    shutil.copytree(GOLDEN_DIR, tmp_path / "suites")
    before = load_suite(tmp_path / "suites" / "golden.yaml")
    png = tmp_path / "suites" / "golden" / "images" / "red_square.png"
    png.write_bytes(png.read_bytes() + b"\0")
    after = load_suite(tmp_path / "suites" / "golden.yaml")
    assert after.task("image_colors").sha256 != before.task("image_colors").sha256
    assert after.task("next_letter").sha256 == before.task("next_letter").sha256
    assert after.sha256 != before.sha256


@pytest.mark.parametrize("tasks, files, match", [
    ([{"name": "m", "type": "multiple_choice", "file": "m.jsonl", "colour": 1}], {"m.jsonl": MC},
     r"unknown key `tasks.0.colour`"),
    ([{"name": "m", "type": "ranking", "file": "m.jsonl"}], {"m.jsonl": MC}, r"tasks.0.type"),
    ([{"name": "m", "type": "multiple_choice", "file": "nope.jsonl"}], {}, r"file not found: .*nope.jsonl"),
    ([{"name": "m", "type": "multiple_choice", "file": "m.jsonl"}],
     {"m.jsonl": json.dumps(MC[0]) + "\n{oops\n"}, r"m.jsonl:2: invalid JSON"),
    ([{"name": "m", "type": "multiple_choice", "file": "m.jsonl"}],
     {"m.jsonl": [{"context": "a", "choices": [" x", " y"], "gold": 2}]}, r"m.jsonl:1: field `gold`"),
    ([{"name": "g", "type": "generation", "file": "g.jsonl"}],
     {"g.jsonl": [{"prompt": "p"}]}, r"g.jsonl:1: field `target`"),
    ([{"name": "i", "type": "multimodal", "file": "i.jsonl"}],
     {"i.jsonl": [{"image": "gone.png", "question": "q", "choices": ["a", "b"], "gold": 0}]},
     r"i.jsonl:1: image not found: .*gone.png"),
    ([{"name": "m", "type": "multiple_choice", "file": "m.jsonl"}] * 2, {"m.jsonl": MC},
     r"duplicate task names: m"),
    ([{"name": "m", "type": "multiple_choice", "file": "m.jsonl"}], {"m.jsonl": ""}, r"has no records"),
    # found only after the model ran (bits per byte 0 / 0) before the check moved to loading
    ([{"name": "p", "type": "perplexity", "file": "p.jsonl"}],
     {"p.jsonl": [{"text": "ab"}, {"text": ""}]}, r"p.jsonl:2: field `text` must be a non-empty"),
    ([{"name": "g", "type": "generation", "file": "g.jsonl"}],
     {"g.jsonl": [{"prompt": "", "target": "x"}]}, r"g.jsonl:1: field `prompt` must be a non-empty"),
])
def test_bad_suites_and_task_files_name_the_fault(tmp_path, tasks, files, match):
    path = write_suite(tmp_path, tasks, files)
    with pytest.raises(UserError, match=match):
        load_suite(path)


def test_bad_yaml_and_unknown_target(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntasks: [\n")
    with pytest.raises(UserError, match=r"bad.yaml:\d+: invalid YAML"):
        load_suite(bad)
    path = write_suite(tmp_path, [{"name": "m", "type": "multiple_choice", "file": "m.jsonl"}],
                       {"m.jsonl": MC}, target_tasks=["other"])
    with pytest.raises(UserError, match="target_tasks names 'other'"):
        load_suite(path)
    with pytest.raises(UserError, match="suite file not found"):
        load_suite(tmp_path / "missing.yaml")


def test_mean_and_ratio_standard_errors():
    mean, se = mean_stderr([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and math.isclose(se, math.sqrt((4 * 0.25 / 3) / 4))
    assert mean_stderr([3.0]) == (3.0, 0.0)
    # equal per-document ratios: no spread, zero error
    r, se = ratio_stderr([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert r == 2.0 and se == 0.0
    r, se = ratio_stderr([1.0, 4.0], [1.0, 1.0])
    assert r == 2.5 and se > 0


def test_scoring_of_each_task_type(tmp_path):
    gen = [{"prompt": "p", "target": " abc"}, {"prompt": "q", "target": ["x", " yz"]}]
    path = write_suite(tmp_path, [
        {"name": "m", "type": "multiple_choice", "file": "m.jsonl"},
        {"name": "e", "type": "generation", "file": "g.jsonl", "match": "exact"},
        {"name": "c", "type": "generation", "file": "g.jsonl", "match": "contains"},
        {"name": "r", "type": "generation", "file": "r.jsonl", "match": "regex"},
        {"name": "p", "type": "perplexity", "file": "p.jsonl"}],
        {"m.jsonl": MC, "g.jsonl": gen, "r.jsonl": [{"prompt": "p", "target": r"^\s*\d+$"}],
         "p.jsonl": [{"text": "ab"}, {"prompt": "x", "completion": "cd"}]})
    suite = load_suite(path)
    # choice 1 " yy" has the higher total but the lower per-character log-likelihood
    m, rows = score_task(suite.task("m"), [{"logliks": [-1.0, -1.5]}, {"logliks": [-1.0, -1.5]}])
    assert m["acc"].value == 0.5 and rows[0]["pred"] == 0
    assert m["acc_norm"].value == 0.5
    outs = [{"output": " abc\nmore"}, {"output": " yz "}]
    assert score_task(suite.task("e"), outs)[0]["exact_match"].value == 1.0
    assert score_task(suite.task("c"), [{"output": "zz abc"}, {"output": "no"}])[0]["contains"].value == 0.5
    assert score_task(suite.task("r"), [{"output": " 42\n"}])[0]["regex_match"].value == 1.0
    p, _ = score_task(suite.task("p"), [{"loglik": -2 * math.log(2), "n_tokens": 1}] * 2)
    assert math.isclose(p["bits_per_byte"].value, 1.0) and not p["bits_per_byte"].higher_is_better
    assert not p["word_perplexity"].gate
    assert truncate("ab\ncd</s>", ["</s>", "\n"]) == "ab"


def _result(suite, values: dict[str, list[float]]):
    """A result dict from per-record log-likelihood pairs of the MC task."""
    raw = {t.name: [{"logliks": v} for v in values[t.name]] for t in suite.tasks}
    return assemble(suite, raw, {}, model="m", adapter=None, settings={})


def test_gate_threshold_is_max_of_abs_tol_and_k_stderr(tmp_path):
    rows = [{"context": str(i), "choices": [" a", " b"], "gold": 0} for i in range(8)]
    path = write_suite(tmp_path, [
        {"name": "m", "type": "multiple_choice", "file": "m.jsonl", "abs_tol": 0.05, "k_stderr": 1.0},
        {"name": "n", "type": "multiple_choice", "file": "m.jsonl", "abs_tol": 0.5, "k_stderr": 0.0}],
        {"m.jsonl": rows})
    suite = load_suite(path)
    good, bad = [-1.0, -2.0], [-2.0, -1.0]
    ref = _result(suite, {"m": [good] * 4 + [bad] * 4, "n": [good] * 8})  # acc 0.5 / 1.0
    same = compare(ref, ref)
    assert not any(r.failed for r in same) and {r.verdict for r in same} == {"pass"}
    worse = _result(suite, {"m": [good] * 2 + [bad] * 6, "n": [good] * 5 + [bad] * 3})
    rows_ = {(r.task, r.metric): r for r in compare(ref, worse)}
    # paired: the stderr of the per-sample differences (two of eight samples flipped)
    diffs = [0.0, 0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    se = (sum((d + 0.25) ** 2 for d in diffs) / 7 / 8) ** 0.5
    assert rows_["m", "acc"].threshold == pytest.approx(max(0.05, se))
    assert rows_["m", "acc"].rule == "paired"
    assert rows_["m", "acc"].failed  # 0.5 -> 0.25 drops more than one paired stderr (0.16)
    assert not rows_["n", "acc"].failed  # 1.0 -> 0.625 stays within abs_tol 0.5
    text = render_text(diff_table(list(rows_.values()), "candidate vs baseline"))
    for word in ("metric", "baseline", "candidate", "delta", "threshold", "verdict", "FAIL"):
        assert word in text
    assert "m/acc 0.5000 -> 0.2500" in failure_summary(list(rows_.values()), "baseline")
    # the fine-tune's own task must improve
    gain = check_gain(ref, worse, ["m"])
    assert gain and all(r.failed for r in gain)  # a row per gated metric, every one failed
    assert not any(r.failed for r in check_gain(worse, ref, ["m"]))


def test_baseline_on_other_data_or_settings_is_refused(tmp_path):
    path = write_suite(tmp_path, [{"name": "m", "type": "multiple_choice", "file": "m.jsonl"}],
                       {"m.jsonl": MC})
    ref = _result(load_suite(path), {"m": [[-1.0, -2.0]] * 2})
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC[::-1]))
    cand = _result(load_suite(path), {"m": [[-1.0, -2.0]] * 2})
    with pytest.raises(UserError, match=r"task m: dataset differs from baseline: m.jsonl \(sha256"):
        compare(ref, cand)
    path = write_suite(tmp_path, [{"name": "m", "type": "multiple_choice", "file": "m.jsonl",
                                   "limit": 1}], {"m.jsonl": MC})
    cand = _result(load_suite(path), {"m": [[-1.0, -2.0]]})
    with pytest.raises(UserError, match="settings differ from baseline: limit None -> 1"):
        compare(ref, cand)
    both = [{"name": n, "type": "multiple_choice", "file": "m.jsonl"} for n in ("m", "z")]
    path = write_suite(tmp_path, both, {"m.jsonl": MC})
    with pytest.raises(UserError, match="baseline has no task 'z'"):
        compare(ref, _result(load_suite(path), {"m": [[-1.0, -2.0]] * 2, "z": [[-1.0, -2.0]] * 2}))
    path = write_suite(tmp_path, both[1:], {"m.jsonl": MC})
    with pytest.raises(UserError, match="baseline has task.s. m that this suite lacks"):
        compare(ref, _result(load_suite(path), {"z": [[-1.0, -2.0]] * 2}))


def test_non_utf8_task_file_and_limit(tmp_path):
    """Undecodable bytes were a raw UnicodeDecodeError traceback."""
    path = write_suite(tmp_path, [{"name": "m", "type": "multiple_choice", "file": "m.jsonl",
                                   "limit": 1}], {"m.jsonl": MC})
    suite = load_suite(path)
    assert len(suite.task("m").records) == 1  # the first `limit` kept, every line checked
    (tmp_path / "m.jsonl").write_bytes(json.dumps(MC[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(UserError, match=r"m.jsonl:2: not UTF-8"):
        load_suite(path)


def test_unreadable_image_is_a_user_error(tmp_path):
    """A corrupt image was a raw PIL traceback; the file check happens before the model."""
    from moeflow.evaluation.runners import HFRunner

    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(UserError, match=rf"image {bad}: cannot read it"):
        HFRunner.image_choice_logliks(None, {"image_path": str(bad), "question": "q",
                                             "choices": ["a", "b"]})


def test_endpoint_answer_that_is_not_json_is_one_line():
    import httpx

    from moeflow.evaluation.endpoint import EndpointRunner

    runner = EndpointRunner("http://test", "m")
    runner.client = httpx.Client(base_url=runner.url, transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text="<html>bad gateway</html>")))
    with pytest.raises(UserError, match=r"/v1/completions: response is not JSON: '<html>"):
        runner.generate(["p"], 4, [])
    runner.close()


def test_lm_eval_task_yaml_with_custom_tags_is_localised(tmp_path):
    """A `!function` tag made safe_load fail and the relative data_files stayed relative
    (resolved against the working dir: another file, or none)."""
    import yaml

    from moeflow.evaluation.lmeval import _localise

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.yaml").write_text(
        "task: x\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: d.jsonl\n"
        "process_docs: !function utils.process_docs\n")
    _localise(tmp_path / "t", tmp_path / "out")
    text = (tmp_path / "out" / "x.yaml").read_text()
    assert "!function" in text and "utils.process_docs" in text
    loader = type("L", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda ld, node: ("fn", ld.construct_scalar(node)))
    cfg = yaml.load(text, Loader=loader)  # noqa: S506
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "t" / "d.jsonl")
    assert cfg["process_docs"] == ("fn", "utils.process_docs")
    (tmp_path / "t" / "x.yaml").write_text("task: [\n")
    with pytest.raises(UserError, match=r"x.yaml: invalid YAML"):
        _localise(tmp_path / "t", tmp_path / "out2")
