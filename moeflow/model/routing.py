"""MoE routing watch: expert load per layer, balance statistics, loss spikes.

Counts come from `steps.RouterTap` (forward hooks on every MoE router: its
own top-k choice, or the top-k of its [T, E] logits). Loads are counted over
top-k selections of non-padding tokens, the way NeMo AutoModel / Megatron
report expert load:
tokens per expert, load entropy (normalised to 1 = perfectly balanced),
max/mean load, and the fraction of experts that received no token.
Axis letters: L MoE layers, T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from moeflow.model.anatomy import VISION_EXPERTS, from_model


def router_modules(model, text_only: bool = True) -> list[tuple[str, torch.nn.Module, int, int]]:
    """Routers of the language model's MoE layers, from its module tree
    (moeflow.model.anatomy): (name, module, decoder layer, experts it routes over).

    A PEFT-wrapped router is found under its own name. With `text_only`,
    ERNIE-4.5-VL's image router (`mlp.vision_moe.gate`) is left out: text
    tokens never reach it.
    """

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    an = from_model(base)
    out = []
    for name in an.routers:
        if text_only and VISION_EXPERTS.search(name):
            continue
        module = base.get_submodule(name)
        layer = next((int(p) for p in reversed(name.split(".")) if p.isdigit()), -1)
        experts = int(getattr(module, "num_experts", 0) or an.num_experts)
        out.append((name, module, layer, experts))
    return out


def find_routers(model) -> list[tuple[str, torch.nn.Module, int]]:
    """MoE router modules of the language model, in layer order (ERNIE-VL's
    image-token routers included): (name, module, num_experts).

    Routers come from the module tree (router_modules:
    the gate / router beside an `experts` container, or a `*Router` /
    `*Gating` module), for any transformers MoE family. transformers 5 routers
    return (logits, weights, expert indices) and hold `top_k`; Llama-4's
    `Llama4Router` returns the router logits and holds `top_k` (it routes
    each token to the top_k of them).
    """
    return [(name, module, experts) for name, module, _, experts in router_modules(model, text_only=False)
            if hasattr(module, "top_k")]


def routed_experts(output, top_k: int, num_experts: int) -> torch.Tensor | None:
    """The expert ids [T, K] a router chose, read from its forward output.

    Routers return different tuples: transformers 5's (logits [T, E], weights [T, K],
    indices [T, K]); Llama-4's (scores, logits [T, E]); JetMoE's `*Gating` (sorted
    positions [T*K], token index [T*K], gates, sizes, logits [T, E]) — so position alone
    does not tell. The router's own [T, K] integer choice wins; else the top_k of its
    last [T, E] float output (its logits); None when it has neither.
    """
    outs = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.dim() >= 2]
    ids = [t for t in tensors if not t.is_floating_point() and t.shape[-1] == top_k]
    if ids:
        return ids[0].detach().reshape(-1, top_k)  # [T, K]
    logits = [t for t in tensors if t.is_floating_point() and t.shape[-1] == num_experts]
    if logits:
        return logits[-1].detach().reshape(-1, num_experts).float().topk(top_k, -1).indices  # [T, K]
    return None


def load_stats(counts: torch.Tensor) -> dict[str, list[float]]:
    """Per-layer balance statistics of a [L, E] count matrix.

    Returns:
        {"entropy": normalised load entropy in [0, 1], "max_over_mean": max / mean
         load, "dead_fraction": share of experts with zero tokens} — lists of L.
    """
    total = counts.sum(-1, keepdim=True).clamp_min(1)  # [L, 1]
    p = counts / total  # [L, E]
    ent = -(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(counts.shape[-1])  # [L]
    mean = counts.mean(-1).clamp_min(1e-12)  # [L]
    return {"entropy": ent.tolist(),
            "max_over_mean": (counts.max(-1).values / mean).tolist(),
            "dead_fraction": (counts == 0).float().mean(-1).tolist()}


def step_metrics(counts: torch.Tensor, layer_ids: list[int]) -> dict[str, float]:
    """Flat MLflow metrics `routing/layer<i>/<stat>` for one step (plus means)."""
    stats = load_stats(counts)
    out: dict[str, float] = {}
    for name, values in stats.items():
        for layer, v in zip(layer_ids, values):
            out[f"routing/layer{layer}/{name}"] = float(v)
        out[f"routing/mean_{name}"] = float(sum(values) / len(values))
    return out


class SpikeDetector:
    """Loss above the rolling mean by `k` standard deviations is a spike.

    Args:
        window: how many recent losses make the baseline.
        k: threshold in standard deviations.
        min_history: no verdicts until this many losses were seen.
    """

    def __init__(self, window: int = 20, k: float = 3.0, min_history: int = 10):
        self.history: deque[float] = deque(maxlen=window)
        self.k = k
        self.min_history = min(min_history, window)

    def update(self, loss: float) -> dict | None:
        """Record `loss`; return {"loss", "mean", "std", "z"} if it is a spike."""
        verdict = None
        if len(self.history) >= self.min_history:
            mean = sum(self.history) / len(self.history)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
            z = (loss - mean) / max(std, 1e-8)
            if z > self.k:
                verdict = {"loss": loss, "mean": mean, "std": std, "z": z}
        self.history.append(loss)
        return verdict


def heatmap_figure(counts: torch.Tensor, layer_ids: list[int], title: str):
    """Matplotlib figure of the layer x expert share of routed tokens."""
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib.pyplot as plt

    share = (counts / counts.sum(-1, keepdim=True).clamp_min(1)).numpy()  # [L, E]
    fig, ax = plt.subplots(figsize=(max(4, share.shape[1] * 0.35), max(2.5, len(layer_ids) * 0.4)))
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(layer_ids)), [str(i) for i in layer_ids])
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="share of routed tokens")
    fig.tight_layout()
    return fig
