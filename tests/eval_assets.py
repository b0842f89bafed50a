"""Shared evaluation test assets: a tiny Qwen3-MoE checkpoint and adapters.

`assets()` builds (once per process) a tiny Qwen3-MoE, a LoRA adapter trained
briefly on the demo task, a random LoRA adapter, and a copy of the base with
one layer's weights perturbed on disk. The eval and regress tests share it.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

from moeflow.evaluation.suite import GOLDEN_SUITE

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@functools.lru_cache(maxsize=None)
def assets() -> dict[str, Path]:
    """Tiny base model, good / random adapters, degraded base (built once per process)."""
    from moeflow_testing.tiny import build_debug_model

    root = Path(tempfile.mkdtemp(prefix="mf-eval-"))
    atexit.register(shutil.rmtree, root, True)
    base = build_debug_model("qwen3_moe", root / "base", dtype="float32")
    return {"root": root, "base": base, "good": _train_adapter(base, root / "good"),
            "random": _random_adapter(base, root / "random"),
            "degraded": perturb_layer(base, root / "degraded", "lm_head.weight")}


def _train_adapter(base: Path, out: Path, steps: int = 20) -> Path:
    """LoRA on attention, a few full-batch steps on the demo task's held-out words."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    rows = [json.loads(line) for line in
            (GOLDEN_SUITE.parent / "golden" / "reverse_heldout.jsonl").read_text().splitlines()]
    enc = tok([r["prompt"] + r["completion"] for r in rows], return_tensors="pt", padding=True)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)  # [N, T]
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        peft_model(**enc, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    peft_model.save_pretrained(out)
    return out


def _random_adapter(base: Path, out: Path) -> Path:
    """An untrained LoRA with random, large A and B, also on lm_head: it damages the model.

    Why lm_head: a random base predicts nearly uniformly (tiny logits), so only
    a change that reaches the logits moves its log-likelihoods much.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS + ["lm_head"],
                     init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(out)
    return out


def perturb_layer(base: Path, out: Path, tensor: str, scale: float = 1.0) -> Path:
    """Copy a checkpoint and add noise to one tensor, rewriting only its shard."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"][tensor]
    tensors = load_file(shard)
    gen = torch.Generator().manual_seed(0)
    w = tensors[tensor]
    tensors[tensor] = w + scale * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    return out


def rewrite_weights(base: Path, out: Path, change) -> Path:
    """Copy a checkpoint, passing every tensor through `change(name, tensor) -> tensor | None`
    (None: unchanged), shard by shard."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        changed = {k: v2 for k, v in tensors.items() if (v2 := change(k, v)) is not None}
        if changed:
            save_file({**tensors, **changed}, shard, metadata={"format": "pt"})
    return out


def scramble_layer(base: Path, out: Path, layer: int = 1, factor: float = 3.0) -> Path:
    """Every 2-D weight of decoder layer `layer` replaced by N(0, (factor x its std)^2)."""
    gen = torch.Generator().manual_seed(0)

    def change(name, w):
        if f".layers.{layer}." in name and w.dim() == 2:
            return (torch.randn(w.shape, generator=gen) * (factor * w.float().std())).to(w.dtype)
        return None
    return rewrite_weights(base, out, change)


def scale_weights(base: Path, out: Path, factor: float = 1 + 1e-6) -> Path:
    """Every floating-point weight multiplied by `factor` (a numerically tiny change),
    saved in float32 (in bfloat16 a factor of 1 + 1e-6 would round back to the weight)."""
    return rewrite_weights(base, out, lambda _n, w: w.float() * factor
                           if w.is_floating_point() else None)


def run_regress_in_mlflow(uri: str, experiment: str, ctx):
    """Call the regress stage the way the runner does: inside an active MLflow run.

    Returns:
        (the stage's record, or the UserError it raised; the MLflow run id).
    """
    import mlflow

    from moeflow.core.errors import UserError
    from tasks.regress import run

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.set_experiment(experiment)
        with mlflow.start_run() as active:
            try:
                return run(ctx), active.info.run_id
            except UserError as exc:
                return exc, active.info.run_id
    finally:
        mlflow.set_tracking_uri(previous)
