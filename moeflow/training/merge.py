"""A LoRA adapter merged into its base: a plain checkpoint (safetensors), written atomically;
a base kept in its release format (convert.dtype keep) is merged into that format
(moeflow.training.merge_kept).

Used by the finetune stage (`finetune.merge`) and by the vLLM backend, which serves expert
adapters vLLM cannot load as LoRA merged, as models of their own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moeflow.checkpoint.manifest import MANIFEST
from moeflow.model.models import kept_formats, load_model

# what an image-text checkpoint needs besides weights and tokenizer to take images
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")


def write_merged(base_dir: str, adapter_dir: Path, out: Path, dtype: str) -> Path:
    """Write base + adapter merged into plain weights (safetensors) at `out`, atomically.

    The base loads with the class training used (moeflow.model.models), so the
    adapter's module names match; an image-text model keeps its vision tower
    and processor files. A temp dir beside `out` is renamed into place last:
    `out` is either absent, an earlier merge, or this one complete.
    """
    if kept_formats(base_dir) or fp8_blocks_kept(base_dir):  # merged into the release's own
        # format, never a bf16 copy
        from moeflow.training.merge_kept import merge_kept

        merge_kept(base_dir, Path(adapter_dir), out)
        return out
    # heavy (torch, PEFT, transformers): imported when a merge runs, not with the callers' modules
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    base = load_model(base_dir, getattr(torch, dtype), trust_remote_code=False)
    # on CPU, where the base is: PEFT would load the adapter onto "cuda" whenever torch sees a
    # GPU, which a stage task (no GPU of its own) does on a GPU host
    merged = PeftModel.from_pretrained(base, str(adapter_dir), torch_device="cpu").merge_and_unload()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(str(tmp))
    for name in PROCESSOR_FILES:
        if (Path(base_dir) / name).is_file():
            shutil.copyfile(Path(base_dir) / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)  # a resumed attempt's earlier merge
    tmp.rename(out)
    return out


def fp8_blocks_kept(model_dir: str | Path) -> bool:
    """A checkpoint `convert --dtype fp8` wrote with FP8 block-scaled weights kept (their
    `*_scale_inv` beside them): merged in that format (moeflow.training.merge_kept)."""
    path = Path(model_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("dtype") == "fp8" and any(k.endswith("_scale_inv") for k in manifest.get("tensors", {}))
