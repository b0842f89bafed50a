"""Parameter accounting from `config.json` alone: no weights read.

The inventory of a model is the `named_parameters()` of the class transformers
loads its config.json as, built on the meta device (no memory; moeflow.model.anatomy),
each tensor tagged with its role (kind) and decoder layer. Totals, active-per-
token counts, per-layer and per-rank byte counts (`moeflow.parallel.memory`) are all sums
over that one inventory, so they equal transformers' own count and cannot drift
apart, for any MoE family transformers ships.

Kinds: embed, head, attention, norm, dense_mlp, router, experts (routed),
vision_experts (ERNIE's routed experts that only image tokens use),
shared_experts, vision (tower), projector, other.

    python -c "from moeflow.model.params import *; \
        print(count_params(spec_from_path('configs/models/mixtral-8x7b.json')))"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeflow.model.anatomy import anatomy, load_config_json

EXPERT_KINDS = ("experts", "vision_experts")  # sharded by EP


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor: in-memory name, shape, kind, decoder layer (None outside layers)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None = None
    tp_dim: int | None = None  # dim cut by tensor parallelism; None: replicated

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ModelSpec:
    """Architecture facts the planner needs, normalised across families."""

    family: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    attention: str  # "gqa" (MHA when kv_heads == heads) or "mla"
    num_experts: int
    experts_per_tok: int
    moe_intermediate: int
    moe_layers: tuple[int, ...]
    shared_intermediate: int = 0  # summed over shared experts; 0 = none
    kv_lora_rank: int = 0  # MLA: cached latent width
    qk_rope_head_dim: int = 0  # MLA: cached rope key width
    layer_windows: tuple[int | None, ...] = ()  # sliding window per layer (None = full)
    linear_attention_layers: int = 0  # token mixers that are not softmax attention (hybrids)
    tie_embeddings: bool = False
    tensors: list[Tensor] = field(default_factory=list, repr=False)
    # kind -> stored low precision of the checkpoint (its quantization_config), e.g.
    # {"experts": "mxfp4"}; kinds absent are held in the plan's weight dtype
    precision: dict[str, str] = field(default_factory=dict)

    @property
    def moe_layer_count(self) -> int:
        return len(self.moe_layers)


@dataclass
class ParamCount:
    """Parameter totals (counts, not bytes)."""

    total: int
    active: int  # per text token, embeddings and head included
    by_kind: dict[str, int]
    active_by_kind: dict[str, int]

    @property
    def vision(self) -> int:
        return self.by_kind.get("vision", 0) + self.by_kind.get("projector", 0)

    @property
    def active_without_embed(self) -> int:
        return self.active - self.active_by_kind.get("embed", 0)

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "active": self.active, "vision": self.vision,
                "active_without_embed": self.active_without_embed,
                "by_kind": dict(self.by_kind), "active_by_kind": dict(self.active_by_kind)}


# ------------------------------------------------------------ config.json I/O


# ------------------------------------------------------------ from the anatomy


_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj",
            "lm_head", "w1", "w3", "c_fc", "fc1", "qkv_proj", "gate_up_proj")
_ROWWISE = ("o_proj", "down_proj", "w2", "c_proj", "fc2", "out_proj", "dense")


def _tp_dim(p, hidden: int) -> int | None:
    """Dim tensor parallelism cuts: column-parallel linears (and the vocab of
    embed / head) on dim 0, row-parallel ones on dim 1; fused 3-D experts on
    their intermediate dim (the one that is not `hidden`); None: replicated."""
    if p.kind in ("vision", "projector", "norm", "router", "other"):
        return None
    if p.kind in ("embed", "head"):
        return 0
    leaf, _, pname = p.name.rpartition(".")
    module = leaf.rpartition(".")[2]
    if len(p.shape) == 3:
        if pname.endswith("bias"):
            return None
        # transformers' fused layout [E, 2I, H] / [E, H, I] by name: the shapes alone are
        # ambiguous when 2I == H
        if pname == "gate_up_proj":
            return 1
        if pname == "down_proj":
            return 2
        if p.shape[1] != hidden:
            return 1
        return 2 if p.shape[2] != hidden else None
    if module in _COLWISE or pname in _COLWISE:
        return 0
    if module in _ROWWISE and pname == "weight" and len(p.shape) == 2:
        return 1
    return None


def _layer_windows(cfg, n: int) -> tuple[int | None, ...]:
    """Sliding-window size per layer (None: full attention), from `layer_types`."""
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if not types or not window:
        return (None,) * n
    return tuple(window if t == "sliding_attention" else None for t in list(types)[:n])


def _linear_layers(cfg, n: int) -> int:
    """Layers whose `layer_types` entry is not softmax attention (linear attention, Mamba:
    a recurrence over the sequence)."""
    types = list(getattr(cfg, "layer_types", None) or ())[:n]
    return sum(t not in ("full_attention", "sliding_attention", "chunked_attention", "attention")
               for t in types)


def _per_layer_width(tensors: list[Tensor], kind: str, layers, hidden: int, per: int = 1) -> int:
    """Intermediate width of one layer's `kind` tensors (3 matrices of H x I,
    divided by `per`, e.g. the expert count): numel / (3 H)."""
    if not layers:
        return 0
    first = layers[0]
    n = sum(t.numel for t in tensors if t.kind == kind and t.layer == first and len(t.shape) >= 2)
    return round(n / max(1, per) / (3 * hidden)) if n else 0


def detect_family(cfg: dict, where: str = "config.json") -> str:
    """The family name of a config.json: its `model_type` when transformers
    builds a mixture-of-experts model from it (by `architectures` when the
    model type is not transformers' own, e.g. kimi_k2).

    Raises:
        UserError: transformers has no class for it, or it has no routed experts.
    """
    anatomy(cfg, where)
    return str(cfg.get("model_type"))


def model_spec(cfg: dict, where: str = "config.json") -> ModelSpec:
    """Normalised architecture + tensor inventory of a config.json dict.

    The inventory is the `named_parameters()` of the class transformers loads
    the config as, built on the meta device (moeflow.model.anatomy), so totals equal
    transformers' own count exactly.

    Args:
        cfg: the parsed config.json (text-only or multimodal package).
        where: name used in error messages (the file path).
    Returns:
        ModelSpec with `tensors` listing every parameter transformers would hold.
    Raises:
        UserError: not a transformers MoE model, naming `where`.
    """
    an = anatomy(cfg, where)
    t = an.text_config
    hidden = int(getattr(t, "hidden_size", 0) or 0)
    heads = int(getattr(t, "num_attention_heads", 0) or 1)
    kv_lora = int(getattr(t, "kv_lora_rank", 0) or 0)
    rope = int(getattr(t, "qk_rope_head_dim", 0) or 0)
    nope = int(getattr(t, "qk_nope_head_dim", 0) or 0)
    mla = bool(kv_lora and rope)
    head_dim = nope + rope if mla else int(getattr(t, "head_dim", 0) or hidden // heads)
    tensors = [Tensor(p.name, p.shape, p.kind, p.layer, _tp_dim(p, hidden)) for p in an.params]
    moe = an.moe_layers
    emb = next((p for p in an.params if p.kind == "embed"), None)
    return ModelSpec(
        family=str(cfg.get("model_type")), hidden=hidden, layers=an.num_layers,
        vocab=int(getattr(t, "vocab_size", 0) or (emb.shape[0] if emb else 0)),
        heads=heads, kv_heads=heads if mla else int(getattr(t, "num_key_value_heads", 0) or heads),
        head_dim=head_dim, attention="mla" if mla else "gqa", num_experts=an.num_experts,
        experts_per_tok=an.top_k,
        moe_intermediate=_per_layer_width(tensors, "experts", moe, hidden, an.num_experts),
        moe_layers=moe, shared_intermediate=_per_layer_width(tensors, "shared_experts", moe, hidden),
        kv_lora_rank=kv_lora if mla else 0, qk_rope_head_dim=rope if mla else 0,
        layer_windows=_layer_windows(t, an.num_layers),
        linear_attention_layers=_linear_layers(t, an.num_layers),
        tie_embeddings=not any(p.kind == "head" for p in an.params), tensors=tensors,
        precision=stored_precision(cfg, tensors))


QUANTISED_KINDS = ("attention", "dense_mlp", "experts", "vision_experts", "shared_experts")


def stored_precision(cfg: dict, tensors: list[Tensor]) -> dict[str, str]:
    """{kind: format} of the weights a release stores quantised (its `quantization_config`):
    MXFP4 (transformers' integration quantises the routed experts), DeepSeek-style FP8
    blocks (every decoder projection), compressed-tensors (the kinds its config groups
    target, by module name, less `ignore`)."""
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if not qc:
        return {}
    method = qc.get("quant_method")
    if method == "mxfp4":
        return {"experts": "mxfp4"}
    if method == "fp8":
        return {k: "fp8" for k in QUANTISED_KINDS}
    if method != "compressed-tensors":
        return {}
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.utils.match import match_name

    out: dict[str, str] = {}
    ignore = qc.get("ignore") or []
    for group in (qc.get("config_groups") or {}).values():
        fmt = _ct_precision((group or {}).get("weights") or {})
        targets = group.get("targets") or []
        for t in tensors:
            module = t.name.rpartition(".")[0]
            if t.kind in out or t.kind not in QUANTISED_KINDS or fmt is None:
                continue
            if ("Linear" in targets or any(match_name(module, x) for x in targets)) \
                    and not any(match_name(module, x) for x in ignore):
                out[t.kind] = fmt
    return out


def _ct_precision(weights: dict) -> str | None:
    bits, kind, group = weights.get("num_bits"), weights.get("type"), weights.get("group_size")
    if bits == 8:
        return "fp8" if kind == "float" else "int8"
    if bits == 4 and kind == "float":
        return "mxfp4" if group == 32 else "nvfp4"
    if bits == 4:
        return "int4"
    return None


def _active_fraction(spec: ModelSpec, t: Tensor) -> float:
    """Share of a tensor one text token touches. The embedding reads one row, but
    the published figures (Mixtral 12.9B, DeepSeek-V3 37B) count it whole."""
    if t.kind == "experts":
        return min(1.0, spec.experts_per_tok / max(1, spec.num_experts))
    if t.kind in ("vision_experts", "vision", "projector"):
        return 0.0
    return 1.0


def count_params(spec: ModelSpec) -> ParamCount:
    """Total and per-token active parameters, by kind.

    Active: routed experts count top-k / E of their parameters; ERNIE's vision
    experts, the vision tower and the projector count zero for a text token;
    everything else (attention, dense MLPs, shared experts, routers, embedding
    and head) counts fully — the convention behind the published figures.
    """
    by_kind: dict[str, int] = {}
    active: dict[str, int] = {}
    for t in spec.tensors:
        by_kind[t.kind] = by_kind.get(t.kind, 0) + t.numel
        active[t.kind] = active.get(t.kind, 0) + round(t.numel * _active_fraction(spec, t))
    return ParamCount(total=sum(by_kind.values()), active=sum(active.values()),
                      by_kind=by_kind, active_by_kind=active)


def spec_from_path(path: str | Path) -> ModelSpec:
    """ModelSpec of a config.json file or checkpoint directory."""
    return model_spec(load_config_json(path), where=str(path))
