"""Shared fixtures: hermetic Ray and MLflow per test module, tiny configs."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from moeflow.core.ports import free_port  # noqa: F401 - the tests take it from here

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# What makes a test module an integration test: it (or the fixtures and helpers it defines)
# starts Ray or Serve, opens an MLflow store, runs the CLI, a subprocess or gloo ranks in
# processes of their own, or talks HTTP or S3. Tiers: `make test-unit` is everything else (pure: tensors, files, parsing, planning).
_SERVICES = re.compile(r"\bray\b\.|import ray\b|run_pipeline|ray_local|ray_session|\bserve\b\.|mlflow"
                       r"|subprocess|s3server|moto|uvicorn|TestClient|CliRunner|http://|urlopen|httpx"
                       r"|\brequests\b|\bsocket\b|raypatient|Popen|cli_env|multiprocessing|spawn")


def _uses_services(path: Path) -> bool:
    return bool(_SERVICES.search(path.read_text()))


def pytest_ignore_collect(collection_path: Path, config):
    """With `-m "... not integration"` (make test-unit), do not even import the modules that
    use services: importing them (Ray, Serve, MLflow) is most of a pure run's time."""
    expr = config.getoption("markexpr") or ""
    if ("not integration" in expr and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and _uses_services(collection_path)):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module that uses services `integration` (unless already slow)."""
    verdict: dict[str, bool] = {}
    for item in items:
        path = str(getattr(item, "path", item.fspath))
        if path not in verdict:
            verdict[path] = _uses_services(Path(path))
        if verdict[path] and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for this module, in its own short temp dir; shut down after."""
    import ray

    from moeflow.serving.ingress import ingress_environment

    temp = tempfile.mkdtemp(prefix="/tmp/mfr")
    # Serve's ingress as a user's moeflow-started Ray has it (deploy.ingress auto);
    # MOEFLOW_TEST_INGRESS=proxy runs the suite through Serve's Python proxy instead
    with ingress_environment(os.environ.get("MOEFLOW_TEST_INGRESS", "auto"), temp):
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield temp
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


_CLI_TEMPS: list[str] = []  # the Ray temp dirs `cli_env` made (short paths outside tmp_path)


def pytest_sessionfinish(session, exitstatus):
    """Remove the Ray temp dirs of the `moeflow` subprocesses (Ray leaves its session there)."""
    for path in _CLI_TEMPS:
        shutil.rmtree(path, ignore_errors=True)


def cli_env(tmp_path: Path, **extra: str) -> dict:
    """Environment for a `moeflow` subprocess: own Ray temp dir (removed when the session ends),
    repo importable."""
    env = dict(os.environ)
    _CLI_TEMPS.append(tempfile.mkdtemp(prefix="/tmp/mfr"))
    env.update(PYTHONPATH=str(REPO), MOEFLOW_RAY_TEMP_DIR=_CLI_TEMPS[-1],
               PATH=f"{BIN}:{env.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    # quiet, as a user's terminal is: an in-process `-v` of an earlier test sets it for this
    # process (so Ray workers inherit it), and a subprocess would print tracebacks beside its line
    env.pop("MOEFLOW_VERBOSE", None)
    env.update(extra)
    return env


def abcd_config(tmp_path: Path, lines: str = "good\n", **over) -> dict:
    """Raw config for the test stages a->b->c, a->d (tests/pipeline_stages.py)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    train = tmp_path / "train.jsonl"
    if not train.exists() or lines is not None:
        train.write_text(lines)
    raw = {
        "name": "abcd", "experiment": "tests", "workdir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_file": str(train)},
        "optimizer": {"lr": 0.05},
        "stages": {"enabled": ["a", "b", "c", "d"], "plugins": ["tests.pipeline_stages"]},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"},
    }
    for key, value in over.items():
        raw[key] = value
    return raw


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module (tiny models: fastest, and robust on a shared
    machine); restored after. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One sqlite MLflow store for the module (creating one costs seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
