"""Parameter accounting from `config.json` alone: no weights, no torch.

Every supported family is described as an inventory of the tensors its
transformers model holds in memory (same names and shapes as
`named_parameters()` of the model built from that config, fused 3-D experts
included), each tagged with a kind and a layer. Totals, active-per-token
counts, per-layer and per-rank byte counts (`moeflow.memory`) are all sums
over that one inventory, so they cannot drift apart.

Hand-written because no library counts parameters without instantiating the
model; tests build the same configs on torch's meta device and compare every
name and shape.

Kinds: embed, head, attention, norm, dense_mlp, router, experts (routed),
vision_experts (ERNIE's routed experts that only image tokens use),
shared_experts, vision (tower), projector.

    python -c "from moeflow.params import *; print(count_params(load_config_json('configs/models/mixtral-8x7b.json')))"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeflow.errors import UserError

EXPERT_KINDS = ("experts", "vision_experts")  # sharded by EP
TEXT_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
VL_FAMILIES = ("qwen3_vl_moe", "ernie4_5_vl_moe", "llama4")


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
    tie_embeddings: bool = False
    tensors: list[Tensor] = field(default_factory=list, repr=False)

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


def load_config_json(path: str | Path) -> dict:
    """Read a model's config.json (a file, or a checkpoint dir holding one).

    Raises:
        UserError: missing file or invalid JSON, naming the path.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"model config not found: {path}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: config.json must be a JSON object")
    return raw


# transformers renames some keys on save (its configs' `attribute_map`): accept every spelling
_ALIASES = {"num_experts": ("num_experts", "num_local_experts"),
            "num_local_experts": ("num_local_experts", "num_experts"),
            "n_routed_experts": ("n_routed_experts", "num_local_experts"),
            "moe_num_experts": ("moe_num_experts", "num_experts"),
            "depth": ("depth", "num_hidden_layers")}


def _req(cfg: dict, key: str, where: str) -> Any:
    for name in _ALIASES.get(key, (key,)):
        if cfg.get(name) is not None:
            return cfg[name]
    raise UserError(f"{where}: config.json has no `{key}`")


def _opt(cfg: dict, key: str, default: Any) -> Any:
    for name in _ALIASES.get(key, (key,)):
        if cfg.get(name) is not None:
            return cfg[name]
    return default


# ------------------------------------------------------------ building blocks


_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj",
            "lm_head")
_ROWWISE = ("o_proj", "down_proj")


def _linear(out: list, name: str, o: int, i: int, kind: str, layer, bias: bool = False) -> None:
    """nn.Linear weight [out, in] (+ bias [out]); TP cuts column-parallel ones on
    dim 0 (bias too), row-parallel ones on dim 1 (bias replicated)."""
    module = name.rsplit(".", 1)[-1]
    col = module in _COLWISE and kind not in ("vision", "projector")
    row = module in _ROWWISE and kind not in ("vision", "projector")
    out.append(Tensor(f"{name}.weight", (o, i), kind, layer, 0 if col else 1 if row else None))
    if bias:
        out.append(Tensor(f"{name}.bias", (o,), kind, layer, 0 if col else None))


def _norm(out: list, name: str, dim: int, kind: str, layer, bias: bool = False) -> None:
    out.append(Tensor(f"{name}.weight", (dim,), kind, layer))
    if bias:
        out.append(Tensor(f"{name}.bias", (dim,), kind, layer))


def _gqa(out, p, c, layer, *, bias=False, qk_norm=False, sinks=False) -> None:
    H, nh, kv, hd = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"]
    if sinks:
        out.append(Tensor(f"{p}.sinks", (nh,), "attention", layer))
    _linear(out, f"{p}.q_proj", nh * hd, H, "attention", layer, bias)
    _linear(out, f"{p}.k_proj", kv * hd, H, "attention", layer, bias)
    _linear(out, f"{p}.v_proj", kv * hd, H, "attention", layer, bias)
    _linear(out, f"{p}.o_proj", H, nh * hd, "attention", layer, bias)
    if qk_norm:
        _norm(out, f"{p}.q_norm", hd, "attention", layer)
        _norm(out, f"{p}.k_norm", hd, "attention", layer)


def _mla(out, p, cfg, H, layer) -> None:
    """DeepSeek multi-head latent attention: low-rank q and a compressed kv latent."""
    nh, nope, rope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    v, kv_r, q_r = cfg["v_head_dim"], cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    bias = bool(cfg.get("attention_bias", False))
    if q_r:
        _linear(out, f"{p}.q_a_proj", q_r, H, "attention", layer, bias)
        _norm(out, f"{p}.q_a_layernorm", q_r, "attention", layer)
        _linear(out, f"{p}.q_b_proj", nh * (nope + rope), q_r, "attention", layer)
    else:
        _linear(out, f"{p}.q_proj", nh * (nope + rope), H, "attention", layer)
    _linear(out, f"{p}.kv_a_proj_with_mqa", kv_r + rope, H, "attention", layer, bias)
    _norm(out, f"{p}.kv_a_layernorm", kv_r, "attention", layer)
    _linear(out, f"{p}.kv_b_proj", nh * (nope + v), kv_r, "attention", layer)
    _linear(out, f"{p}.o_proj", H, nh * v, "attention", layer, bias)


def _mlp(out, p, H, inter, kind, layer, bias=False) -> None:
    _linear(out, f"{p}.gate_proj", inter, H, kind, layer, bias)
    _linear(out, f"{p}.up_proj", inter, H, kind, layer, bias)
    _linear(out, f"{p}.down_proj", H, inter, kind, layer, bias)


def _experts(out, p, E, H, inter, layer, *, transposed=False, bias=False, kind="experts") -> None:
    """Fused experts as transformers holds them: gate_up [E, 2I, H], down [E, H, I]
    (GPT-OSS and Llama-4 store the transposes [E, H, 2I], [E, I, H])."""
    gate_up = (E, H, 2 * inter) if transposed else (E, 2 * inter, H)
    down = (E, inter, H) if transposed else (E, H, inter)
    # TP (used only when EP == 1) cuts the intermediate dim
    out.append(Tensor(f"{p}.gate_up_proj", gate_up, kind, layer, 2 if transposed else 1))
    if bias:
        out.append(Tensor(f"{p}.gate_up_proj_bias", (E, 2 * inter), kind, layer, 1))
    out.append(Tensor(f"{p}.down_proj", down, kind, layer, 1 if transposed else 2))
    if bias:
        out.append(Tensor(f"{p}.down_proj_bias", (E, H), kind, layer))


def _embed_head(out, cfg, embed_name, head_name, final_norm) -> None:
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    out.append(Tensor(embed_name, (V, H), "embed", None, 0))  # vocab-parallel
    _norm(out, final_norm, H, "norm", None)
    # tied: transformers shares one Parameter, named_parameters() lists it once
    if not cfg.get("tie_word_embeddings", False):
        out.append(Tensor(head_name, (V, H), "head", None, 0))


# ------------------------------------------------------------ text backbones


def _text_dims(cfg: dict, where: str) -> dict:
    H = _req(cfg, "hidden_size", where)
    nh = _req(cfg, "num_attention_heads", where)
    return {"hidden": H, "heads": nh, "kv_heads": cfg.get("num_key_value_heads") or nh,
            "head_dim": cfg.get("head_dim") or H // nh}


def _qwen3_moe_layers(cfg: dict, n: int) -> tuple[int, ...]:
    only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    E = _opt(cfg, "num_experts", 0)
    return tuple(i for i in range(n) if i not in only and E > 0 and (i + 1) % step == 0)


def _layer_windows(cfg: dict, n: int) -> tuple[int | None, ...]:
    """Sliding-window size per layer (None: full attention), from `layer_types`."""
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if not types or not window:
        return (None,) * n
    return tuple(window if t == "sliding_attention" else None for t in types[:n])


def _moe_layout(family: str, cfg: dict, d: dict, L: int, where: str):
    """(experts, expert intermediate, MoE layer indices, extra facts) of a text config."""
    extra: dict[str, Any] = {}
    if family in ("mixtral", "gpt_oss"):
        E, I = _req(cfg, "num_local_experts", where), _req(cfg, "intermediate_size", where)
        moe = tuple(range(L))
    elif family in ("qwen3_moe", "qwen3_vl_moe"):
        E, I = _req(cfg, "num_experts", where), _req(cfg, "moe_intermediate_size", where)
        moe = _qwen3_moe_layers(cfg, L)
    elif family == "deepseek_v3":
        E, I = _req(cfg, "n_routed_experts", where), _req(cfg, "moe_intermediate_size", where)
        moe = tuple(range(cfg.get("first_k_dense_replace", 3), L))
        nope, rope = _req(cfg, "qk_nope_head_dim", where), _req(cfg, "qk_rope_head_dim", where)
        extra = dict(attention="mla", kv_lora_rank=_req(cfg, "kv_lora_rank", where),
                     kv_heads=d["heads"], head_dim=nope + rope, qk_rope_head_dim=rope,
                     shared_intermediate=I * (cfg.get("n_shared_experts") or 0))
    elif family == "llama4":
        E, I = _req(cfg, "num_local_experts", where), _req(cfg, "intermediate_size", where)
        step = cfg.get("interleave_moe_layer_step", 1) or 1
        moe = tuple(cfg.get("moe_layers") or range(step - 1, L, step))
        extra = {"shared_intermediate": I}
    else:  # ernie4_5_vl_moe: text and vision experts side by side
        E = _opt(cfg, "moe_num_experts", 64)
        I = (cfg.get("moe_intermediate_size") or [1536, 512])[0]
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (L - 1)
        moe = tuple(i for i, t in enumerate(types[:L]) if t == "sparse")
        extra = {"shared_intermediate": I * (cfg.get("moe_num_shared_experts", 2) or 0)}
    return E, I, moe, extra


def _build_text(family: str, cfg: dict, prefix: str, where: str) -> tuple[list[Tensor], dict]:
    """Tensors of a text decoder of `family` under `prefix` (e.g. "model.")."""
    d = _text_dims(cfg, where)
    H, L = d["hidden"], _req(cfg, "num_hidden_layers", where)
    E, I, moe, extra = _moe_layout(family, cfg, d, L, where)
    facts: dict[str, Any] = dict(d, layers=L, attention="gqa", shared_intermediate=0)
    facts.update(extra, num_experts=E, moe_intermediate=I, moe_layers=moe,
                 experts_per_tok=cfg.get("num_experts_per_tok") or cfg.get("moe_k") or 1,
                 layer_windows=_layer_windows(cfg, L))
    mlp_name = "feed_forward" if family == "llama4" else "mlp"
    dense = cfg.get("intermediate_size_mlp") if family == "llama4" else cfg.get("intermediate_size")
    if dense is None and len(moe) < L:
        raise UserError(f"{where}: dense layers need `intermediate_size`"
                        f"{'_mlp' if family == 'llama4' else ''}")
    out: list[Tensor] = []
    moe_set = set(moe)
    for i in range(L):
        p = f"{prefix}layers.{i}"
        _attention(out, family, cfg, d, f"{p}.self_attn", i)
        _norm(out, f"{p}.input_layernorm", H, "norm", i)
        _norm(out, f"{p}.post_attention_layernorm", H, "norm", i)
        if i in moe_set:
            _moe_block(out, family, cfg, f"{p}.{mlp_name}", H, E, I, i)
        else:
            _mlp(out, f"{p}.{mlp_name}", H, dense, "dense_mlp", i,
                 bias=bool(cfg.get("use_bias")) and family == "ernie4_5_vl_moe")
    return out, facts


def _attention(out, family, cfg, d, p, i) -> None:
    if family == "deepseek_v3":
        _mla(out, p, cfg, d["hidden"], i)
    elif family == "gpt_oss":
        _gqa(out, p, d, i, bias=cfg.get("attention_bias", True), sinks=True)
    elif family == "ernie4_5_vl_moe":
        _gqa(out, p, d, i, bias=bool(cfg.get("use_bias")))
    else:
        _gqa(out, p, d, i, bias=bool(cfg.get("attention_bias")),
             qk_norm=family in ("qwen3_moe", "qwen3_vl_moe"))


def _moe_block(out, family, cfg, p, H, E, I, i) -> None:
    """Router + routed experts (+ shared experts) of one MoE layer."""
    if family == "gpt_oss":
        _linear(out, f"{p}.router", E, H, "router", i, bias=True)
        _experts(out, f"{p}.experts", E, H, I, i, transposed=True, bias=True)
    elif family == "llama4":
        _linear(out, f"{p}.router", E, H, "router", i)
        _experts(out, f"{p}.experts", E, H, I, i, transposed=True)
        _mlp(out, f"{p}.shared_expert", H, I, "shared_experts", i)
    elif family == "ernie4_5_vl_moe":
        vision_I = (cfg.get("moe_intermediate_size") or [1536, 512])[1]
        for sub, inter, kind in (("text_moe", I, "experts"), ("vision_moe", vision_I, "vision_experts")):
            _linear(out, f"{p}.{sub}.gate", E, H, "router", i)
            out.append(Tensor(f"{p}.{sub}.gate.moe_statics.e_score_correction_bias", (1, E), "router", i))
            _experts(out, f"{p}.{sub}.experts", E, H, inter, i, kind=kind)
        shared = I * (cfg.get("moe_num_shared_experts", 2) or 0)
        if shared:
            _mlp(out, f"{p}.shared_experts", H, shared, "shared_experts", i,
                 bias=bool(cfg.get("use_bias")))
    else:
        _experts(out, f"{p}.experts", E, H, I, i)
        _linear(out, f"{p}.gate", E, H, "router", i)
        if family == "deepseek_v3" and cfg.get("n_shared_experts"):
            _mlp(out, f"{p}.shared_experts", H, I * cfg["n_shared_experts"], "shared_experts", i)


# ------------------------------------------------------------ vision towers


def _vit_block(out, p, h, inter, names) -> None:
    """A pre-norm ViT block with biased LayerNorms and a fused or split qkv."""
    n1, n2, qkv, proj, fc1, fc2 = names
    _norm(out, f"{p}.{n1}", h, "vision", None, bias=True)
    _norm(out, f"{p}.{n2}", h, "vision", None, bias=True)
    if qkv:
        _linear(out, f"{p}.{qkv}", 3 * h, h, "vision", None, bias=True)
    else:
        for q in ("q_proj", "k_proj", "v_proj"):
            _linear(out, f"{p}.self_attn.{q}", h, h, "vision", None, bias=True)
    _linear(out, f"{p}.{proj}", h, h, "vision", None, bias=True)
    _linear(out, f"{p}.{fc1}", inter, h, "vision", None, bias=True)
    _linear(out, f"{p}.{fc2}", h, inter, "vision", None, bias=True)


def _vision_qwen3_vl(v: dict) -> list[Tensor]:
    h, inter, m = v.get("hidden_size", 1152), v.get("intermediate_size", 4304), v.get("spatial_merge_size", 2)
    ps, tp, ch = v.get("patch_size", 16), v.get("temporal_patch_size", 2), v.get("in_channels", 3)
    out_h, merged = v.get("out_hidden_size", 3584), h * m * m
    out = [Tensor("model.visual.patch_embed.proj.weight", (h, ch, tp, ps, ps), "vision"),
           Tensor("model.visual.patch_embed.proj.bias", (h,), "vision"),
           Tensor("model.visual.pos_embed.weight", (v.get("num_position_embeddings", 2304), h), "vision")]
    for b in range(_opt(v, "depth", 27)):
        _vit_block(out, f"model.visual.blocks.{b}", h, inter,
                   ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"))
    mergers = [("model.visual.merger", h)] + [
        (f"model.visual.deepstack_merger_list.{k}", merged)
        for k in range(len(v.get("deepstack_visual_indexes", (8, 16, 24))))]
    for p, norm_dim in mergers:  # deepstack mergers normalise after the 2x2 shuffle
        _norm(out, f"{p}.norm", norm_dim, "projector", None, bias=True)
        _linear(out, f"{p}.linear_fc1", merged, merged, "projector", None, bias=True)
        _linear(out, f"{p}.linear_fc2", out_h, merged, "projector", None, bias=True)
    return out


def _vision_ernie(v: dict, text_hidden: int) -> list[Tensor]:
    h, ps, ch = v.get("hidden_size", 1280), v.get("patch_size", 14), v.get("in_channels", 3)
    inter, m = v.get("intermediate_size", 4 * h), v.get("spatial_merge_size", 2)
    t, s = v.get("temporal_merge_size", 2), h * m * m
    out = [Tensor("model.vision_tower.patch_embed.proj.weight", (h, ch * ps * ps), "vision")]
    for b in range(_opt(v, "depth", 32)):
        _vit_block(out, f"model.vision_tower.blocks.{b}", h, inter,
                   ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))
    _norm(out, "model.vision_tower.ln", h, "vision", None, bias=True)
    r = "model.resampler_model"
    _linear(out, f"{r}.spatial_linear.fc1", s, s, "projector", None, bias=True)
    _linear(out, f"{r}.spatial_linear.fc2", s, s, "projector", None, bias=True)
    _norm(out, f"{r}.spatial_linear.ln", s, "projector", None, bias=True)
    _linear(out, f"{r}.temporal_linear.fc1", s, s * t, "projector", None, bias=True)
    _linear(out, f"{r}.temporal_linear.fc2", s, s, "projector", None, bias=True)
    _norm(out, f"{r}.temporal_linear.ln", s, "projector", None, bias=True)
    _linear(out, f"{r}.mlp", text_hidden, s, "projector", None, bias=True)
    _norm(out, f"{r}.after_norm", text_hidden, "projector", None)
    return out


def _vision_llama4(v: dict, text_hidden: int) -> list[Tensor]:
    h, inter = v.get("hidden_size", 768), v.get("intermediate_size", 5632)
    ps, img, ch = v.get("patch_size", 14), v.get("image_size", 448), v.get("num_channels", 3)
    p = "vision_model"
    out = [Tensor(f"{p}.class_embedding", (h,), "vision"),
           Tensor(f"{p}.positional_embedding_vlm", ((img // ps) ** 2 + 1, h), "vision"),
           Tensor(f"{p}.patch_embedding.linear.weight", (h, ch * ps * ps), "vision")]
    for n in ("layernorm_pre", "layernorm_post"):
        _norm(out, f"{p}.{n}", h, "vision", None, bias=True)
    for b in range(v.get("num_hidden_layers", 34)):
        _vit_block(out, f"{p}.model.layers.{b}", h, inter,
                   ("input_layernorm", "post_attention_layernorm", None, "self_attn.o_proj",
                    "mlp.fc1", "mlp.fc2"))
    # the adapter's fc1 reads the pixel-shuffled features (vision intermediate_size wide)
    _linear(out, f"{p}.vision_adapter.mlp.fc1", v.get("projector_input_dim", 4096), inter, "projector", None)
    pod = v.get("projector_output_dim", 4096)
    _linear(out, f"{p}.vision_adapter.mlp.fc2", pod, pod, "projector", None)
    _linear(out, "multi_modal_projector.linear_1", text_hidden, v.get("vision_output_dim", 7680),
            "projector", None)
    return out


# ------------------------------------------------------------ entry points


def detect_family(cfg: dict, where: str = "config.json") -> str:
    """The family name of a config.json (its `model_type`, normalised)."""
    mt = str(cfg.get("model_type", ""))
    if mt == "llama4_text":
        return "llama4"
    if mt in TEXT_FAMILIES + VL_FAMILIES:
        return mt
    raise UserError(f"{where}: model_type {mt!r} is not a supported MoE family; "
                    f"supported: {', '.join(TEXT_FAMILIES + VL_FAMILIES)}")


_LAYOUT = {  # family -> (decoder prefix, head name); the embedding lives under the prefix
    "qwen3_vl_moe": ("model.language_model.", "lm_head.weight"),
    "ernie4_5_vl_moe": ("model.language_model.", "lm_head.weight"),
    "llama4": ("language_model.model.", "language_model.lm_head.weight"),
}


def model_spec(cfg: dict, where: str = "config.json") -> ModelSpec:
    """Normalised architecture + tensor inventory of a config.json dict.

    Args:
        cfg: the parsed config.json (text-only or multimodal package).
        where: name used in error messages (the file path).
    Returns:
        ModelSpec with `tensors` listing every parameter transformers would hold.
    """
    family = detect_family(cfg, where)
    nested = "text_config" in cfg
    text = dict(cfg.get("text_config") or cfg)
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings",
                                                  family == "ernie4_5_vl_moe"))
    text["tie_word_embeddings"] = tie
    if family == "llama4" and not nested:  # a bare Llama4ForCausalLM text config
        prefix, head = "model.", "lm_head.weight"
    else:
        prefix, head = _LAYOUT.get(family, ("model.", "lm_head.weight"))
    _req(text, "vocab_size", where)
    tensors, facts = _build_text(family, text, prefix, where)
    _embed_head(tensors, text, f"{prefix}embed_tokens.weight", head, f"{prefix}norm")
    vision = cfg.get("vision_config")
    if nested and vision is not None:
        H = text["hidden_size"]
        build = {"qwen3_vl_moe": lambda: _vision_qwen3_vl(vision),
                 "ernie4_5_vl_moe": lambda: _vision_ernie(vision, H),
                 "llama4": lambda: _vision_llama4(vision, H)}[family]
        tensors.extend(build())
    return ModelSpec(family=family, vocab=text["vocab_size"], tie_embeddings=bool(tie),
                     tensors=tensors, **facts)


def _active_fraction(spec: ModelSpec, t: Tensor) -> float:
    """Share of a tensor one text token touches. The embedding reads one row, but
    the published figures (Mixtral 12.9B, DeepSeek-V3 37B) count it whole."""
    if t.kind == "experts":
        return spec.experts_per_tok / spec.num_experts
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
