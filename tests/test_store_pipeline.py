"""The runner with `workdir: s3://...` on a real local Ray and an S3-compatible server:
stages hand each other store URIs, read fetched copies under their node's scratch, and a
finished output is recognised (and reused) by its manifest."""

import json
import os

import pytest
from mlflow.tracking import MlflowClient

from moeflow.core import storage as S
from moeflow.core import tracking as T
from moeflow.core.config import validate
from tests.s3server import BUCKET, s3_server
from workflows.runner import run_pipeline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store_ray(tmp_path_factory):
    """moto's server, then a local Ray whose workers inherit its AWS_* environment."""
    saved = dict(os.environ)
    scratch = tmp_path_factory.mktemp("scratch")
    with s3_server() as env:
        os.environ.update(env, MOEFLOW_SCRATCH=str(scratch))
        import ray

        from tests.conftest import REPO

        temp = str(tmp_path_factory.mktemp("ray"))
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        try:
            yield scratch
        finally:
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved)


def _config(tmp_path, prefix: str) -> dict:
    (tmp_path / "model").mkdir(exist_ok=True)
    return {"name": "store", "experiment": f"store-{prefix}", "workdir": f"s3://{BUCKET}/{prefix}",
            "model": {"path": str(tmp_path / "model")},
            "stages": {"enabled": ["make", "read", "reread"], "plugins": ["tests.store_stages"]},
            "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}}


def test_stages_hand_off_through_the_store(store_ray, tmp_path):
    out = run_pipeline(validate(_config(tmp_path, "p1")), stages={})
    assert out.ok, {n: s.error for n, s in out.stages.items()}
    make, read = out.stages["make"].result, out.stages["read"].result
    root = f"s3://{BUCKET}/p1/{out.run_id}/"
    assert make["file"].startswith(root) and make["data_dir"].startswith(root)  # URIs, not paths
    assert read["upstream_dir"] == make["data_dir"]  # a fetched copy's path maps back to its URI
    assert read["text"] == "made+made" and out.stages["reread"].result["text"] == "made+made"
    for name, st in out.stages.items():
        assert st.out_dir.startswith(root) and S.published(st.out_dir), name
        manifest, _ = S.read_manifest(st.out_dir)
        assert "result.json" in manifest["files"]
        assert json.loads(S.read_text(f"{st.out_dir}/result.json")) == st.result
    assert "make x" not in json.dumps(make) and "notes.log" in S.read_manifest(
        out.stages["make"].out_dir)[0]["files"]
    # nothing of the stages' work dirs is left on the scratch: only cache entries
    assert not list((store_ray / "stages").rglob("*.txt"))
    # make's output, adopted into this node's cache as published (no second copy: read's fetch
    # of make's data_dir is a cache hit, and nothing of it lingers in a stage's work dir)
    copies = list(store_ray.rglob("unread.bin"))
    assert len(copies) == 1 and copies[0].is_relative_to(S.cache_root()), copies
    origin = json.loads((copies[0].parent / ".origin").read_text())
    assert origin == {"uri": out.stages["make"].out_dir, "how": "published"}
    client = MlflowClient(out.tracking_uri)
    exp = client.get_experiment_by_name("store-p1")
    assert exp.artifact_location == f"s3://{BUCKET}/p1/mlflow-artifacts"
    child = client.get_run(out.stages["read"].run_id)
    assert child.info.artifact_uri.startswith(f"s3://{BUCKET}/p1/mlflow-artifacts/")
    assert "result.json" in [a.path for a in client.list_artifacts(child.info.run_id)]
    again = run_pipeline(validate(_config(tmp_path, "p1")), stages={})
    assert {n: s.state for n, s in again.stages.items()} == dict.fromkeys(
        ["make", "read", "reread"], "reused")
    S.remove(f"{out.stages['reread'].out_dir}/{S.MANIFEST}")  # an output gone from the store
    third = run_pipeline(validate(_config(tmp_path, "p1")), stages={})
    assert third.stages["reread"].state == "done" and third.stages["make"].state == "reused"
    assert client.get_run(out.run_id).data.tags[T.KIND] == "pipeline"
