"""Checkpoints with skewed routing for the operators tests and benchmark.

A random tiny model routes almost uniformly. `skewed_checkpoint` makes chosen
experts hot the way a trained router would: it adds the mean direction of the
router's own inputs (measured on a few texts) to those experts' router rows,
so their logits rise for most tokens; DeepSeek-style routers also get their
`e_score_correction_bias` raised. The hot experts are the lowest ids, so the
contiguous expert-parallel split puts them all on rank 0.
"""

from __future__ import annotations

from pathlib import Path

TEXTS = ["reverse: abc\nanswer: cba", "the quick brown fox jumps over the lazy dog",
         "experts in a mixture are chosen per token", "hello, how are you? i am fine."]


def skew_routers(model, texts=TEXTS, hot=(0, 1), strength: float = 4.0) -> None:
    """Raise the router logits of experts `hot` (hottest first) in place."""
    import torch
    from transformers import AutoTokenizer

    from moeflow.model.routing import find_routers

    routers = find_routers(model)
    means = {}

    def grab(name):
        def hook(_module, args):
            means[name] = args[0].reshape(-1, args[0].shape[-1]).float().mean(0)  # [H]
        return hook

    handles = [m.register_forward_pre_hook(grab(n)) for n, m, _ in routers]
    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    with torch.no_grad():
        model(**tok(" ".join(texts), return_tensors="pt"))
        for h in handles:
            h.remove()
        for name, module, _ in routers:
            u = means[name]
            for rank, e in enumerate(hot):
                boost = strength / (rank + 1)
                module.weight[e] += (boost * u / u.dot(u)).to(module.weight.dtype)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias[e] += boost / 4


def skewed_checkpoint(family: str, work: Path, hot=(0, 1), strength: float = 4.0, **overrides) -> Path:
    """Build a tiny `family` model, skew its routers, convert it; the converted dir."""
    import torch

    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.model.models import load_model
    from moeflow_testing.tiny import build_debug_model

    src = build_debug_model(family, work / f"{family}-random", **overrides)
    model = load_model(src, torch.bfloat16)
    skew_routers(model, hot=hot, strength=strength)
    model.save_pretrained(str(work / f"{family}-skewed"), max_shard_size="100KB")
    for f in src.iterdir():  # tokenizer and generation files
        if not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                   "model.safetensors.index.json"):
            (work / f"{family}-skewed" / f.name).write_bytes(f.read_bytes())
    out = work / f"{family}-converted"
    convert_checkpoint(work / f"{family}-skewed", out, dtype="keep")
    return out
