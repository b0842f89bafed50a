"""Baselines in a real MLflow store (sqlite) and the `moeflow regress` command."""

from __future__ import annotations

import shutil
import sys

import pytest
import typer
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from moeflow.core.errors import UserError
from moeflow.evaluation.baseline import compare, load_baseline, record_baseline
from moeflow.evaluation.record import flat_metrics
from moeflow.evaluation.report import diff_table, render_text
from moeflow.evaluation.runners import evaluate
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite
from tests.eval_assets import assets

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def uri(mlflow_uri):
    return mlflow_uri


@pytest.fixture(scope="module")
def results():
    a = assets()
    base, = evaluate(load_suite(), a["base"])
    degraded, = evaluate(load_suite(), a["degraded"])
    return {"base": base, "degraded": degraded}


def test_record_load_and_gate(uri, results):
    run_id = record_baseline("golden-v1", results["base"], tracking_uri=uri, experiment="t",
                             extra={"manifest_sha256": "abc", "seed": 0})
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.tags["moeflow.baseline"] == "golden-v1"
    assert run.data.tags["moeflow.suite_sha256"] == load_suite().sha256
    assert run.data.metrics == pytest.approx(flat_metrics(results["base"]))
    assert run.data.params["eval.version.transformers"]
    assert uri[len("sqlite:///"):-len("mlflow.db")] in run.info.artifact_uri  # not in the CWD

    found_id, ref = load_baseline("golden-v1", tracking_uri=uri)
    assert found_id == run_id and ref["manifest_sha256"] == "abc"
    assert ref["tasks"]["reverse_em"]["samples"][0]["output"] == \
        results["base"]["tasks"]["reverse_em"]["samples"][0]["output"]
    # the latest baseline of this suite, by hash
    assert load_baseline(None, tracking_uri=uri, suite_sha256=load_suite().sha256)[0] == run_id
    assert load_baseline(None, tracking_uri=uri, suite_sha256="0" * 64) is None

    # a candidate equal to the baseline passes
    again, = evaluate(load_suite(), assets()["base"])
    assert not any(r.failed for r in compare(ref, again, label="baseline 'golden-v1'"))
    # weights perturbed in one layer: fails, and the table says where
    rows = compare(ref, results["degraded"], label="baseline 'golden-v1'")
    failed = {(r.task, r.metric) for r in rows if r.failed}
    assert ("plain_text", "bits_per_byte") in failed and ("reverse_nll", "bits_per_byte") in failed
    text = render_text(diff_table(rows, "degraded vs baseline"))
    assert "plain_text" in text and "FAIL" in text


def test_missing_baseline_and_bad_names(uri):
    with pytest.raises(UserError, match="no baseline named 'nope'.*--record-baseline nope"):
        load_baseline("nope", tracking_uri=uri)
    with pytest.raises(UserError, match="baseline name"):
        load_baseline("x' or '1'='1", tracking_uri=uri)


# ---------------------------------------------------------------- CLI


def _app() -> typer.Typer:
    from workflows.commands import regress

    app = typer.Typer()
    regress.register(app)
    app.command("noop")(lambda: None)  # two commands: typer keeps the `regress` name
    return app


def test_cli_record_then_compare(uri):
    a = assets()
    runner, app = CliRunner(), _app()
    common = ["--tracking-uri", uri, "--experiment", "cli"]
    rec = runner.invoke(app, ["regress", "--model", str(a["base"]), "--record-baseline", "v1", *common])
    assert rec.exit_code == 0, rec.output
    assert "recorded baseline 'v1'" in rec.output and "image_colors" in rec.output

    same = runner.invoke(app, ["regress", "--model", str(a["base"]), "--baseline", "v1", *common])
    assert same.exit_code == 0, same.output
    assert "FAIL" not in same.output and "verdict" in same.output

    bad = runner.invoke(app, ["regress", "--model", str(a["base"]), "--adapter", str(a["random"]),
                              "--baseline", "v1", *common])
    assert bad.exit_code == 1, bad.output
    assert "FAIL" in bad.output and "regressed vs baseline 'v1'" in bad.output
    runs = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("cli").experiment_id],
        filter_string="tags.`moeflow.passed` = 'false'")
    assert len(runs) == 1 and runs[0].data.params["eval.adapter"] == str(a["random"])


def test_cli_changed_dataset_names_the_file(tmp_path, uri):
    shutil.copytree(GOLDEN_SUITE.parent, tmp_path / "suites")
    suite = tmp_path / "suites" / "golden.yaml"
    common = ["--tracking-uri", uri, "--suite", str(suite), "--model", str(assets()["base"])]
    runner, app = CliRunner(), _app()
    assert runner.invoke(app, ["regress", "--record-baseline", "v2", *common]).exit_code == 0
    data = tmp_path / "suites" / "golden" / "plain_text.jsonl"
    data.write_text(data.read_text() + '{"text": "one more line"}\n')
    out = runner.invoke(app, ["regress", "--baseline", "v2", *common])
    assert isinstance(out.exception, UserError)
    assert "dataset differs from baseline 'v2': golden/plain_text.jsonl" in str(out.exception)


def test_cli_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from workflows import cli

    monkeypatch.setattr(sys, "argv", ["moeflow", "regress", "--model", str(tmp_path / "none"),
                                      "--tracking-uri", f"sqlite:///{tmp_path}/m.db"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not a Hugging Face checkpoint dir" in err and "Traceback" not in err


# ---------------------------------------------------------------- half-written / old baselines


def _tiny_result(sha: str) -> dict:
    metric = {"value": 0.5, "stderr": 0.1, "higher_is_better": True, "gate": True}
    return {"suite": "s", "suite_sha256": sha, "model": "m", "adapter": None,
            "settings": {"seed": 0}, "versions": {"python": "3"},
            "tasks": {"t": {"metrics": {"acc": metric}, "samples": [{"index": 0, "acc": 1.0}],
                            "n": 1, "dataset": {"sha256": "d", "files": {}}}}}


def test_a_half_written_baseline_is_never_found(uri, monkeypatch):
    """The baseline tag was set before the results artifact: a failed upload left a
    RUNNING run that `load_baseline` found and then could not read."""
    sha = "1" * 64

    def broken(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(MlflowClient, "log_table", broken)
    with pytest.raises(OSError, match="disk full"):
        record_baseline("half", _tiny_result(sha), tracking_uri=uri, experiment="half")
    assert load_baseline(None, tracking_uri=uri, suite_sha256=sha) is None
    with pytest.raises(UserError, match="no baseline named 'half'"):
        load_baseline("half", tracking_uri=uri)
    runs = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("half").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def test_baseline_older_than_many_evaluation_runs_is_found(uri):
    """The suite lookup post-filtered the latest 200 runs of the suite: a baseline
    older than 200 plain evaluation runs was silently missed (no gate)."""
    sha = "2" * 64
    run_id = record_baseline("old", _tiny_result(sha), tracking_uri=uri, experiment="many")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("many").experiment_id
    for _ in range(201):  # plain evaluation runs of the same suite, newer than the baseline
        client.create_run(exp, tags={"moeflow.suite_sha256": sha})
    found = load_baseline(None, tracking_uri=uri, suite_sha256=sha)
    assert found is not None and found[0] == run_id


def test_baseline_without_results_artifact_is_one_line(uri):
    """A tagged run without its results.json was a raw MLflow traceback."""
    client = MlflowClient(uri)
    exp = client.create_experiment("noart", artifact_location=uri[len("sqlite:///"):-len(
        "mlflow.db")] + "noart-artifacts")
    run_id = client.create_run(exp, tags={"moeflow.baseline": "noart"}).info.run_id
    with pytest.raises(UserError, match=rf"baseline 'noart' \(MLflow run {run_id}\): cannot read"):
        load_baseline("noart", tracking_uri=uri)


def test_an_unnamed_lookup_takes_the_last_baseline_on_the_same_architecture(uri):
    """A store holding the demo's (Qwen3-MoE) baseline: a GLM-4.5 pipeline's regress compares
    with baselines recorded on GLM-4.5 bases only; a named baseline is taken whatever its base."""
    from moeflow.evaluation.baseline import BASE_ARCH_TAG

    sha = "3" * 64
    qwen = record_baseline("demo", _tiny_result(sha), tracking_uri=uri, experiment="arch",
                           tags={BASE_ARCH_TAG: "Qwen3MoeForCausalLM"})
    assert load_baseline(None, tracking_uri=uri, suite_sha256=sha,
                         base_arch="Glm4MoeForCausalLM") is None
    assert load_baseline(None, tracking_uri=uri, suite_sha256=sha,
                         base_arch="Qwen3MoeForCausalLM")[0] == qwen
    glm = record_baseline("glm", _tiny_result(sha), tracking_uri=uri, experiment="arch",
                          tags={BASE_ARCH_TAG: "Glm4MoeForCausalLM"})
    assert load_baseline(None, tracking_uri=uri, suite_sha256=sha,
                         base_arch="Qwen3MoeForCausalLM")[0] == qwen  # not the newer GLM one
    assert load_baseline(None, tracking_uri=uri, suite_sha256=sha)[0] == glm  # no base given
    assert load_baseline("demo", tracking_uri=uri, base_arch="Glm4MoeForCausalLM")[0] == qwen
    with pytest.raises(UserError, match="not a class name"):
        load_baseline(None, tracking_uri=uri, suite_sha256=sha, base_arch="x' or '1'='1")
