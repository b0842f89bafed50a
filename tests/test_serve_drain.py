"""SIGTERM of `moeflow serve` lets the request in flight finish (Serve's graceful shutdown, at
most DRAIN_S) before Ray stops, and the command exits 143 as `run` does (Ctrl-C: 130)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.conftest import REPO, cli_env

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_sigterm_finishes_the_stream_in_flight_then_exits_143(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "model": {"path": str(REPO / "assets" / "demo-base")},
                                   "deploy": {"num_replicas": 1, "port": 0}}))
    proc = subprocess.Popen([sys.executable, "-m", "workflows.cli", "serve", str(cfg)], cwd=tmp_path,
                            env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, tokens, finish = [], 0, None
    try:
        for line in proc.stdout:
            lines.append(line)
            if "serving in the foreground" in line:
                break
        url = next(line.split()[3] for line in lines if line.startswith("OpenAI base URL:"))
        body = {"model": "demo-base", "prompt": "Hello", "max_tokens": 200, "min_tokens": 200, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_lines():
                if not chunk.startswith("data: {"):
                    continue
                choice = json.loads(chunk[6:])["choices"][0]
                if tokens == 0:
                    proc.send_signal(signal.SIGTERM)  # the stream is under way
                tokens += 1
                finish = choice.get("finish_reason") or finish
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines) + out
    assert finish == "length", out  # the whole completion came, not a cut stream
    assert proc.returncode == 143, out
    assert "requests in flight" in out
