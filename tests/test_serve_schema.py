"""Schemathesis (`--checks all`) against the served app's own /openapi.json: no 5xx, every status
and body as documented, schema-invalid input refused. The app runs in process on uvicorn with a
tiny model; the default suite runs a bounded sample, the slow test at least 2,000 cases."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeflow.serving.app import ServeSettings, free_port
from moeflow_testing.serving import LocalServer, make_lora_adapter
from moeflow_testing.tiny import build_debug_model

pytestmark = pytest.mark.integration
CONFIG = Path(__file__).parent / "data" / "schemathesis.toml"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("schema")
    base = build_debug_model("qwen3_moe", root / "tiny-moe")
    make_lora_adapter(base, root / "adapters" / "a1", seed=1)
    settings = ServeSettings(base_dir=str(base), adapter_root=str(root / "adapters"),
                             adapters={"a1": str(root / "adapters" / "a1")}, max_request_bytes=2 ** 20)
    with LocalServer(settings, free_port()) as server:
        yield server.url


def _schemathesis(url: str, examples: int, tmp_path: Path) -> int:
    """Run the CLI; returns the number of generated cases (fails the test on any finding)."""
    exe = Path(sys.executable).with_name("schemathesis")
    cmd = [str(exe), "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "--checks", "all",
           "--max-examples", str(examples), "--seed", "11", "--workers", "1", "--no-color",
           "--request-timeout", "60", "--report", "junit", "--report-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)  # .hypothesis/ there
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    cases = int(re.search(r"(\d+) generated", out.stdout).group(1))
    print(f"schemathesis: {cases} cases, no failures")
    return cases


def test_schemathesis_bounded(url, tmp_path):
    assert _schemathesis(url, 25, tmp_path) >= 300


@pytest.mark.slow
def test_schemathesis_two_thousand_cases(url, tmp_path):
    assert _schemathesis(url, 400, tmp_path) >= 2000
