"""Is an adapter what the serving engine will apply? Checked before it is gated or deployed.

The commonest MoE-LoRA failure is an adapter that loads and then does nothing: tensor
prefixes or an expert layout the engine does not map to its modules. Each engine's own
loading code is run on the adapter, without a forward and without the base's weights:

- local: moeflow's engine (moeflow.serving.adapters.check_compatible, what a replica runs
  before PEFT touches its model) against the model built on the meta device from config.json;
- vllm: vLLM's LoRA loading (moeflow/serving/vllm_lora_check.py, in the vLLM environment)
  against the checkpoint's safetensors headers, for an adapter the vllm backend serves as
  LoRA (one it serves merged is not loaded by vLLM). A fused 3-D expert adapter (PEFT
  target_parameters) is checked as the vllm backend serves it: its per-expert export
  (moeflow.training.adapter_layout).

    from moeflow.serving.adapter_check import check_adapters
    check_adapters(base_dir, {"a1": "lora/a1"}, backend="vllm")  # UserError naming the tensors
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.model.params import load_config_json
from moeflow.serving import vllm_run
from moeflow.serving.vllm_backend import adapter_kind
from moeflow.training.adapter_layout import export_per_expert


def local_problems(base_dir: str | Path, adapter_dir: str | Path) -> list[str]:
    """What moeflow's engine refuses in the adapter (the first problem, one line), or []."""
    # lazy: the meta model imports transformers (seconds); only this check needs it
    from moeflow.model.anatomy import meta_model
    from moeflow.serving.adapters import check_compatible

    model, _ = meta_model(load_config_json(base_dir), where=str(Path(base_dir) / "config.json"))
    try:
        check_compatible(adapter_dir, model)
    except UserError as exc:
        return [str(exc)]
    return []


def vllm_problems(base_dir: str | Path, adapter_dir: str | Path, max_lora_rank: int = 512) -> list[str]:
    """What vLLM's LoRA loading refuses, or would load and never apply; UserError when no vLLM
    environment exists (its line names `make setup-vllm`)."""

    if why := vllm_run.vllm_missing():
        raise UserError(f"the vllm adapter check: {why}")
    script = Path(__file__).with_name("vllm_lora_check.py")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(vllm_run.vllm_python()), str(script), str(base_dir), str(adapter_dir),
                           "--max-lora-rank", str(max_lora_rank)], capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"the vllm adapter check of {adapter_dir} failed to run: {tail}")
    return json.loads(lines[-1])["problems"]


def _served_by_vllm(base_dir: str | Path, path: str | Path) -> list[str] | None:
    """vLLM's check of the adapter as the vllm backend serves it (a fused expert one: its
    per-expert export); None when vLLM never loads it (no per-expert layout: served merged)."""
    if adapter_kind(path)[0] != "expert_parameters":
        return vllm_problems(base_dir, path)
    with tempfile.TemporaryDirectory(prefix="moeflow-vllm-lora-") as tmp:
        try:
            export = export_per_expert(base_dir, path, Path(tmp) / "adapter")
        except UserError:  # vllm_backend.build serves it merged, and says why
            return None
        return vllm_problems(base_dir, export)


def check_adapters(base_dir: str | Path, adapters: dict[str, str], backend: str,
                   vllm_lora: set[str] | None = None) -> dict:
    """Run each engine's check on every adapter; the findings per adapter and engine.

    Args:
        adapters: {name: PEFT dir}.
        backend: the deployment's backend; "vllm" adds vLLM's check where a vLLM environment
            exists (else the record says it was not run, and why: the deployment itself
            needs that environment and will say so).
        vllm_lora: the adapters the vllm backend serves as LoRA (None: all of them).
    Returns:
        {"adapters": {name: {engine: [problems]}}, "not_checked": {engine: why}}.
    Raises:
        UserError: one line per refused adapter, naming the engine and the tensors.
    """

    found: dict[str, dict[str, list[str]]] = {}
    skipped = {"vllm": why} if backend == "vllm" and (why := vllm_run.vllm_missing()) else {}
    for name, path in adapters.items():
        found[name] = {"local": local_problems(base_dir, path)}
        if backend == "vllm" and not skipped and (vllm_lora is None or name in vllm_lora):
            if (problems := _served_by_vllm(base_dir, path)) is not None:
                found[name]["vllm"] = problems
    bad = [f"adapter {name!r} ({engine} engine): {'; '.join(p[:3])}" + (f" (+{len(p) - 3} more)" if len(p) > 3 else "")
           for name, by in found.items() for engine, p in by.items() if p]
    if bad:
        raise UserError("the serving engine would not apply the adapter as trained: " + " | ".join(bad))
    return {"adapters": found, "not_checked": skipped}
