"""The endpoint runner against moeflow's own OpenAI-compatible server (Ray Serve, HTTP).

A baseline recorded in process must hold for the deployed model: the same
suite through `/v1/completions` gives the same log-likelihoods (echo +
logprobs) and the same greedy generations, for the base and for an adapter.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.evaluation.baseline import compare
from moeflow.evaluation.endpoint import EndpointRunner, evaluate_endpoint
from moeflow.evaluation.record import flat_metrics
from moeflow.evaluation.runners import evaluate
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite
from tests.eval_assets import assets

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(ray_local):
    from ray import serve

    from moeflow.serving.app import ServeSettings, free_port, start

    a = assets()
    settings = ServeSettings(base_dir=str(a["base"]), served_model_name="base",
                             adapters={"good": str(a["good"])})
    yield start(settings, port=free_port())
    serve.shutdown()


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """The golden suite, 8 records per task (HTTP round trips are the cost here)."""
    root = tmp_path_factory.mktemp("suite")
    golden = GOLDEN_SUITE.parent / "golden"
    text = GOLDEN_SUITE.read_text().replace("file: golden/", f"file: {golden}/")
    text = text.replace("    type: ", "    limit: 8\n    type: ")
    (root / "s.yaml").write_text(text)
    return load_suite(root / "s.yaml")


def test_endpoint_matches_in_process_for_base_and_adapter(server, suite):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = evaluate(suite, assets()["base"], [None, assets()["good"]])
    finally:
        torch.set_num_threads(before)
    for name, reference in zip(("base", "good"), local):
        remote = evaluate_endpoint(suite, server, name)
        assert "completions API carries no images" in remote["tasks"]["image_colors"]["skipped"]
        lm, rm = flat_metrics(reference), flat_metrics(remote)
        assert lm.keys() == rm.keys()
        for key in lm:
            assert rm[key] == pytest.approx(lm[key], rel=1e-3, abs=1e-3), (name, key)
        assert ([s["output"] for s in remote["tasks"]["reverse_em"]["samples"]]
                == [s["output"] for s in reference["tasks"]["reverse_em"]["samples"]])
        # a baseline recorded in process holds for the deployed model (images: skipped there)
        reference["tasks"].pop("image_colors")
        remote["tasks"].pop("image_colors")
        assert not any(r.failed for r in compare(reference, remote, label="in-process"))
    assert (flat_metrics(evaluate_endpoint(suite, server, "good"))["eval/reverse_nll/bits_per_byte"]
            < flat_metrics(local[0])["eval/reverse_nll/bits_per_byte"])


def test_endpoint_errors_are_one_line(server):
    with pytest.raises(UserError, match="HTTP 404"):
        EndpointRunner(server, "no-such-model").generate(["hi"], 2, [])
    with pytest.raises(UserError, match="endpoint http://127.0.0.1:9/v1: ConnectError"):
        EndpointRunner("http://127.0.0.1:9", "base", timeout=5).loglikelihood([("a", " b")])


def test_cli_checks_the_deployed_model_against_an_in_process_baseline(server, suite, tmp_path):
    from typer.testing import CliRunner

    from tests.test_regress_baseline import _app

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = ["regress", "--suite", str(suite.path), "--tracking-uri", uri]
    runner, app = CliRunner(), _app()
    rec = runner.invoke(app, [*common, "--model", str(assets()["base"]), "--record-baseline", "b"])
    assert rec.exit_code == 0, rec.output
    same = runner.invoke(app, [*common, "--endpoint", server, "--served-model", "base",
                               "--baseline", "b"])
    assert same.exit_code == 0, same.output
    assert "FAIL" not in same.output and "pass" in same.output
    other = runner.invoke(app, [*common, "--endpoint", server, "--served-model", "good",
                                "--baseline", "b"])
    assert other.exit_code == 0, other.output  # it improves the demo task
    assert "better" in other.output
