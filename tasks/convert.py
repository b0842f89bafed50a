"""Stage `convert`: parse, convert and verify the model checkpoint (`model.path`).

Writes the converted checkpoint to `<out_dir>/converted` (one safetensors file
per decoder layer, fused experts under runtime names, manifest.json with
checksums, config and tokenizer files) and logs the manifest and the
verification report to MLflow when a run is active. Output files are converted
in parallel as Ray tasks when the stage runs on Ray (`convert.workers`, default
one per CPU of the cluster).

Resumable: a Ray retry or `moeflow resume` continues in the same out dir, and
files an earlier attempt finished are kept when their recorded per-tensor
checksums still match (moeflow/checkpoint/convert.py); only the rest convert.

    moeflow run configs/demo.yaml --only convert     (through the pipeline)
    moeflow convert SRC OUT --workers 2              (alone)
"""

from __future__ import annotations

import shutil
import time

from moeflow.checkpoint.report import log_to_mlflow
from moeflow.core.config import PipelineConfig
from moeflow.core.hardware import load_hardware
from moeflow.model.remote_code import activate
from tasks.base import StageContext, StageSpec


def run(ctx: StageContext) -> dict:
    """Convert `model.path` into `ctx.out_dir/converted`.

    Returns:
        {"output_dir", "manifest", "manifest_sha256", "family", "source_dir",
         "architecture", "tensors", "files", "bytes", "seconds", "verified",
         "mismatches", "logits_max_abs_diff", "resumed_files", "headline", "memory"}
        (memory: each process's peak bytes, moeflow.checkpoint.convert.convert_checkpoint).
    """
    # lazy: loads numpy, torch, which importing this module does not
    from moeflow.checkpoint.convert import convert_checkpoint

    cfg = ctx.config.convert
    out = ctx.out_dir / "converted"
    if out.exists():  # finished but unrecorded (killed between rename and record): redo
        shutil.rmtree(out)
    kept: list[str] = []

    def progress(message: str) -> None:
        if message.startswith("kept "):
            kept.append(message)
        elif message.startswith("read "):  # by ranges from a store: what it fetched
            ctx.note(message)

    # a process of this stage holds at most a device's share (the functional check then
    # goes layer by layer, moeflow.checkpoint.verify.functional_check)
    budget = load_hardware(ctx.config.hardware.spec, ctx.config.hardware.nodes).memory_bytes
    start = time.perf_counter()
    result = convert_checkpoint(ctx.config.model.path, out, dtype=cfg.dtype,
                                workers=cfg.workers, allow_nonfinite=cfg.allow_nonfinite,
                                checksum=cfg.checksum, progress=progress, memory_budget=budget)
    result["seconds"] = round(time.perf_counter() - start, 3)
    if kept:
        ctx.note(f"resumed: {len(kept)} of {result['files']} files kept from the earlier "
                 "attempt (their recorded checksums verified)")
    log_to_mlflow(result)
    report = result.pop("report")
    functional = report.get("functional") or {}
    headline = {"seconds": result["seconds"], "bytes": result["bytes"],
                "gb_per_s": result["bytes"] / 1e9 / max(result["seconds"], 1e-9),
                "verified": report["passed"], "resumed_files": len(kept)}
    if functional.get("logits_max_abs_diff") is not None:
        headline["logits_max_abs_diff"] = functional["logits_max_abs_diff"]
    return dict(result, verified=report["passed"], mismatches=report["mismatches"],
                logits_max_abs_diff=functional.get("logits_max_abs_diff"),
                resumed_files=len(kept), headline=headline)


def preflight(cfg: PipelineConfig) -> None:
    """Cheap checks before the DAG starts: the checkpoint parses and is a supported MoE."""
    # lazy: loads torch, which importing this module does not
    from moeflow.checkpoint.families import load_family
    from moeflow.checkpoint.parse import read_checkpoint


    activate(cfg.model.path, trust=cfg.model.trust_remote_code)  # its own classes, when it has them
    ckpt = read_checkpoint(cfg.model.path)
    load_family(ckpt.config, str(ckpt.path / "config.json"))


STAGE = StageSpec(
    name="convert",
    run=run,
    upstream=(),
    sections=("model", "convert"),
    num_cpus=1,
    preflight=preflight,
    resumable=True,  # files finished by an earlier attempt are kept once their checksums verify
    model_by_ranges=True,  # a store checkpoint: only the tensors converted are read
    description="parse, convert (fused experts, one file per layer) and verify the checkpoint",
)
