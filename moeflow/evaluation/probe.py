"""What a base model has learned: held-out perplexity and expert-load skew.

- `heldout_perplexity`: token perplexity of texts, compared with the uniform
  vocabulary's (which is the vocabulary size): a ratio well below 1 means the
  model predicts the language.
- `expert_load`: tokens routed to every expert of every MoE layer (hooks on the
  routers found by moeflow.model.routing.find_routers, so every family
  transformers routes with a `*TopKRouter` counts the same way); `max/mean`
  per layer is the skew the operators stage's hot-expert placement needs.
"""

from __future__ import annotations

import math
from pathlib import Path

from moeflow.core.devices import local_device, model_device
from moeflow.model.models import load_model


def heldout_perplexity(model, tokenizer, texts: list[str]) -> float:
    """exp(mean next-token NLL) over `texts`, each scored after an EOS token.

    Args:
        model: a causal LM in eval mode.
        tokenizer: its tokenizer.
        texts: held-out documents, scored one at a time (no padding).

    Returns:
        Token perplexity.
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch


    device = model_device(model)
    total, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([[tokenizer.eos_token_id] + tokenizer(
            text, add_special_tokens=False).input_ids], device=device)  # [1, T]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        total += float(nll)
        count += ids.shape[1] - 1
    return math.exp(total / count)


def expert_load(model, tokenizer, texts: list[str]) -> tuple[list[str], list[list[int]]]:
    """Tokens routed to each expert, per MoE layer, over `texts` (one at a time).

    Returns:
        (router module names, counts [MoE layers][experts]).
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch

    from moeflow.model.routing import find_routers

    device = model_device(model)
    routers = find_routers(model)
    width = max((e for _, _, e in routers), default=0)
    counts = torch.zeros(len(routers), width, dtype=torch.long)  # [L, E] on CPU, any model device

    def hook(layer: int):
        def count(module, _inputs, output):
            chosen = output[-1]  # [T, top_k] expert ids
            if chosen.is_floating_point():  # router logits [T, E] (Llama-4): take the top_k
                chosen = chosen.topk(module.top_k, dim=-1).indices
            counts[layer] += torch.bincount(chosen.reshape(-1), minlength=width).cpu()
        return count

    handles = [m.register_forward_hook(hook(i)) for i, (_, m, _) in enumerate(routers)]
    try:
        for text in texts:
            ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids], device=device)  # [1, T]
            with torch.no_grad():
                model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return [name for name, _, _ in routers], counts.tolist()


def load_skew(counts: list[list[int]]) -> list[float]:
    """max/mean tokens per expert, per layer (1.0 = perfectly even)."""
    out = []
    for row in counts:
        mean = sum(row) / len(row) if row else 0.0
        out.append(max(row) / mean if mean else 0.0)
    return out


def probe_model(model_dir: str | Path, heldout: list[str], prompts: list[str]) -> dict:
    """Load a checkpoint and measure held-out perplexity and expert-load skew.

    Args:
        model_dir: HF checkpoint dir.
        heldout: held-out texts of the language the model was trained on.
        prompts: texts whose routing is counted (e.g. the golden suite's prompts).

    Returns:
        {"heldout_ppl", "uniform_ppl", "ppl_ratio", "routers", "expert_load",
         "load_max_over_mean" (per layer), "max_load_skew"}
    """
    # lazy: torch, transformers: heavy, loaded only when this runs
    import torch
    import transformers


    # the stage's GPU when Ray granted one (regress asks for it), in float32 as the golden
    # suite's perplexities are, so the ratio means the same on every device
    model = load_model(str(model_dir), torch.float32).eval().to(local_device())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ppl = heldout_perplexity(model, tokenizer, heldout)
    vocab = model.config.get_text_config().vocab_size
    names, counts = expert_load(model, tokenizer, prompts)
    skew = load_skew(counts)
    return {"heldout_ppl": ppl, "uniform_ppl": float(vocab), "ppl_ratio": ppl / vocab,
            "routers": names, "expert_load": counts, "load_max_over_mean": skew,
            "max_load_skew": max(skew, default=0.0)}
