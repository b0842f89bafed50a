"""benchmarks/gpu_check.sh runs only where a GPU is lent; what of it a CPU host can check is
checked here: the script's syntax, every Python program it calls existing, importing and
accepting the flags the script passes it, and its vLLM step (benchmarks/gpu_vllm_lora.py)
up to serving: the model, the fused expert adapter, its per-expert export checked by vLLM's
own loading, and the Serve config with the adapter as LoRA (--dry-run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moeflow.serving import vllm_run

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def calls() -> list[list[str]]:
    """Every `$PY ...` command of the script, as argv after $PY (continuation lines joined)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "$PY " not in line:
            continue
        cmd = line.split("$PY ", 1)[1].split("|")[0].split("2>&1")[0]
        out.append(shlex.split(cmd.replace('"$OUT', '"/tmp/out')))
    return out


def test_the_script_parses_and_names_programs_that_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    argvs = calls()
    scripts = {a[0] for a in argvs if a[0].endswith(".py")}
    assert {"benchmarks/gpu_check.py", "benchmarks/gpu_vllm_lora.py", "benchmarks/bench_engine.py",
            "benchmarks/gpu_engine_check.py"} <= scripts
    for path in scripts:
        assert (REPO / path).is_file(), path
        compile((REPO / path).read_text(), path, "exec")  # a syntax error fails here
    assert ["-m", "workflows.cli", "demo"] == [a for a in argvs if a[0] == "-m" and a[1] == "workflows.cli"][0][:3]


@pytest.mark.slow  # a python per program, each importing torch: a minute on a loaded host
def test_every_program_accepts_the_flags_the_script_passes():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    seen = {}
    for argv in calls():
        if argv[0] == "-m" and argv[1] == "pytest":
            continue
        if argv[0] == "-c":  # the devices line: its code compiles and what it imports exists
            compile(argv[1], "gpu_check.sh", "exec")
            from moeflow.core.devices import describe  # noqa: F401
            continue
        prog = argv[:3] if argv[0] == "-m" else argv[:1]
        sub = [a for a in argv[len(prog):] if not a.startswith("-")][:1]  # a subcommand (gpu_check.py serve)
        sub = sub if argv[0].endswith("gpu_check.py") else []
        key = " ".join(prog + sub)
        if key not in seen:
            proc = subprocess.run([sys.executable, *prog, *sub, "--help"], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"{key} --help: {proc.stderr[-800:]}"
            seen[key] = proc.stdout
        for flag in re.findall(r"(?<!\S)(--[a-z][a-z-]*)", " ".join(argv[len(prog):])):
            assert flag in seen[key], f"gpu_check.sh passes {flag} to {key}, which does not take it"


@pytest.mark.slow  # builds the model and adapter, runs vLLM's loading in its venv
@pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))
def test_the_vllm_lora_step_runs_up_to_serving(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_vllm_lora.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "vllm_lora.json").read_text())
    assert summary["checks"]["adapters"]["a1"] == {"local": [], "vllm": []}  # both engines' loading
    (export,) = summary["uploads"]
    assert summary["uploads"][export] == "s3://moeflow/adapters/a1" and "vllm-lora" in export
    (app,) = summary["serve_config"]["applications"]
    (llm,) = app["args"]["llm_configs"]
    assert llm["engine_kwargs"]["enable_lora"] and llm["lora_config"]["dynamic_lora_loading_path"] == \
        "s3://moeflow/adapters"
