"""Whether vLLM's CPU build can run the routed experts of a release kept in (or merged into)
its quantised format, asked of vLLM itself before anything starts.

vLLM runs a quantised MoE layer on CPU only through its CPU fused-MoE kernels
(`vllm.model_executor.layers.fused_moe.experts.cpu_moe`), one per weight format, each
of which says whether it runs on this host (`_supports_current_device`: vLLM 0.29 needs
x86 with AMX for INT4, FP8 and MXFP4) and which schemes it takes (FP8: 128x128 blocks
only). Otherwise the replica fails minutes later: INT4 with "No WNA16 MoE backend
supports the deployment configuration", FP8 with "Unsupported FP8 MoE backend: NONE"
(measured here: a host without AMX). The table below maps a release format to the
kernel vLLM would pick: what vLLM exposes is the kernels, not a format -> kernel query.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from moeflow.checkpoint import formats
from moeflow.checkpoint.parse import read_checkpoint

# release format -> vLLM's CPU experts kernel (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py)
CPU_EXPERTS = {"pack-quantized": "CPUExpertsInt4", "float-quantized": "CPUExpertsFp8",
               "mxfp4": "CPUExpertsMxfp4", "mxfp4-pack-quantized": "CPUExpertsMxfp4",
               "int-quantized": "CPUExpertsInt8", "fp8-block": "CPUExpertsFp8"}
FP8_BLOCK = [128, 128]  # the one FP8 weight layout vLLM's CPU kernel takes (kFp8Static128BlockSym)


def expert_formats(model_dir: str | Path) -> dict[str, str]:
    """{release format of routed-expert weights: a detail ("" or the FP8 block)}."""
    ckpt = read_checkpoint(model_dir)
    packed, _ = formats.find_packed(ckpt)
    out: dict[str, str] = {}
    for name, info in packed.items():
        if ".experts." in name:
            scheme = json.loads(info.scheme or "{}").get("weights") or {}
            out[info.format] = str(scheme.get("block_structure") or scheme.get("strategy") or "")
    qc = ckpt.config.get("quantization_config") or {}
    if any(k.endswith("_scale_inv") and ".experts." in k for k in ckpt.tensors):
        out["fp8-block"] = str(qc.get("weight_block_size"))
    return out


def vllm_cpu_refusal(model_dir: str | Path, python: str | Path) -> str | None:
    """One line saying why vLLM's CPU build (at `python`) cannot run this checkpoint's
    routed experts on this host, or None when it can (or they are not quantised)."""
    wanted = expert_formats(model_dir)
    if not wanted:
        return None
    names = sorted({CPU_EXPERTS.get(f, "") for f in wanted} - {""})
    code = ("import json; from vllm.model_executor.layers.fused_moe.experts import cpu_moe as m; "
            f"print(json.dumps({{n: bool(getattr(m, n)._supports_current_device()) "
            f"for n in {names!r} if hasattr(m, n)}}))")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    if proc.returncode != 0:
        return (f"vLLM's CPU MoE kernels could not be asked about {model_dir}: "
                f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    for fmt, detail in sorted(wanted.items()):
        kernel = CPU_EXPERTS.get(fmt)
        if kernel is None or kernel not in runs:
            why = f"vLLM's CPU build has no MoE kernel for {fmt}"
        elif not runs[kernel]:
            why = f"vLLM's CPU {kernel} kernel does not run on this host (x86 with AMX only)"
        elif kernel == "CPUExpertsFp8" and detail != str(FP8_BLOCK):
            why = f"vLLM's CPU FP8 MoE kernel takes {FP8_BLOCK} blocks only, these are {detail}"
        else:
            continue
        return (f"{model_dir}: routed experts stored {fmt}: {why}; serve it with deploy.backend "
                "local, or on a GPU cluster")
    return None
