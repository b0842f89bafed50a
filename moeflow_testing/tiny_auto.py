"""Tiny configs of any transformers MoE family, derived from the family's own
default config (its config class with no arguments), so a family transformers
adds tomorrow gets a debug model without a code change here.

The shrink is by key name, recursively through nested configs (text_config,
vision_config, ...): widths, depths, head counts, expert counts, top-k, LoRA
ranks of MLA, vocabulary and per-layer lists are cut to debug sizes, keeping
the ratios the modeling code checks (head_dim = hidden / heads where the
family derives it, M-RoPE sections summing to head_dim / 2, one dense layer
before the MoE layers where the family has one, MLA's head_dim = nope + rope
where the full-size config has it, per-layer overrides shrunk alike; sizes of 0
stay 0).

What a default config leaves to the checkpoint is filled from transformers
itself: per-layer kind lists from its allowed layer types that the family's
modeling code names, an M-RoPE split the modeling code defaults, indexer sizes
for indexed-attention layers, a sliding window where the family sizes sliding
layers, token ids the modeling code reads, experts switched on where the
default names them but turns them off, one attention layer in a hybrid whose
default has only recurrent ones.

    python -c "from moeflow_testing.tiny_auto import tiny_config; print(tiny_config('olmoe'))"
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings

from moeflow.model.anatomy import EXPERT_COUNT_KEYS, TOP_K_KEYS

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 4, 2, 16, 2
EXPERTS, TOP_K = 4, 2
VISION_HIDDEN = 32

# key -> value for a text (decoder) config; applied when the key is present
_TEXT = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "intermediate_size": 128, "ffn_hidden_size": 128, "intermediate_size_mlp": 128,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32, "moe_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "dense_intermediate_size": 128,
    "expert_ffn_hidden_size": 32, "ffn_dim": 128,
    "max_position_embeddings": 512, "sliding_window": 16, "attention_chunk_size": 64,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "qk_head_dim": 32, "index_head_dim": 16, "index_n_heads": 2,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4, "mamba_n_heads": 8,
    "mamba_head_dim": 16, "mamba_d_head": 16, "mamba_d_state": 16,
    "ssm_state_size": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
    "time_step_rank": 8, "n_groups": 1, "mamba_n_groups": 1, "conv_kernel": 4,
    "kv_channels": HEAD_DIM, "num_shared_experts": 1, "n_shared_experts": 1,
    "moe_num_shared_experts": 1, "first_k_dense_replace": 1, "first_k_dense": 1,
    "num_dense_layers": 1, "moe_layer_start_index": 1, "decoder_sparse_step": 1,
    "interleave_moe_layer_step": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    "mtp_num_layers": 0, "num_mtp_layers": 0, "zero_expert_num": 0,
}
_VISION = {
    "hidden_size": VISION_HIDDEN, "intermediate_size": 64, "num_heads": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "depth": 1,
    "num_hidden_layers": 1, "num_layers": 1, "patch_size": 8, "image_size": 32,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16,
    "out_hidden_size": HIDDEN, "projector_input_dim": 64, "projector_output_dim": 64,
    "vision_output_dim": 64, "embed_dim": VISION_HIDDEN, "hidden_act": None,
    "text_hidden_size": HIDDEN, "n_layers": 1, "encoder_layers": 1, "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64, "d_model": VISION_HIDDEN, "output_dim": HIDDEN,
    "downsample_hidden_size": 32, "num_mel_bins": 16, "n_mel_bins": 16,
}
_MOE_SWITCHES = ("is_moe", "use_moe", "enable_moe", "moe")
_TOPK_LIKE = re.compile(r"(top_?k|per_tok|activated_experts)", re.I)
_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "hybrid_override_pattern",
                "block_types", "moe_layers_enum", "mlp_only_layers", "full_attn_idxs",
                "no_rope_layers", "attn_layer_indices", "moe_layers", "layer_group_size",
                "sliding_window_pattern_list", "swa_layers", "full_attention_layers")


def tiny_config(model_type: str, vocab_size: int = 512):
    """A debug-size transformers config of `model_type`, from its default config.

    Raises:
        ValueError: transformers has no such model type, or no generative class.
    """
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import CONFIG_MAPPING

    generative_class(model_type)
    config_cls = CONFIG_MAPPING[model_type]
    shrunk = shrink(config_cls().to_dict(), vocab_size)
    _fill_layer_kinds(shrunk, config_cls)
    _fill_mrope(shrunk, config_cls)
    _keep_an_attention_layer(shrunk, config_cls)
    for key in ("model_type", "transformers_version", "architectures"):
        shrunk.pop(key, None)
    config = config_cls(**{k: v for k, v in shrunk.items() if not k.startswith("_")})
    _declare_read_token_ids(config, config_cls, vocab_size)
    return config


def _declare_read_token_ids(config, config_cls, vocab_size: int) -> None:
    """Token ids the modeling code reads off its config (`self.config.vision_start_token_id`)
    that the config class does not declare (Qwen3-Omni's thinker: released config.json files
    carry them) get distinct ids at the top of the tiny vocabulary, below the ones in use."""
    read = sorted(set(re.findall(r"self\.config\.(\w+_token_id)\b", _modeling_source(config_cls))))
    missing = [k for k in read if not hasattr(config, k)]
    if not missing:
        return
    used = {v for k, v in config.to_dict().items() if k.endswith("_id") and isinstance(v, int)}
    free = (i for i in range(vocab_size - 1, 0, -1) if i not in used)
    for key in missing:
        setattr(config, key, next(free))


def generative_class(model_type: str):
    """The Auto class moeflow.model.models loads `model_type` with: causal-LM where
    transformers maps the type to one, else image-text."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    raise ValueError(f"{model_type}: transformers has no causal-LM or image-text class")


def tiny_model(model_type: str, vocab_size: int = 512, config=None):
    """A random debug model of `model_type`, of the class moeflow loads it as
    (`architectures` set to it, as save_pretrained writes it)."""
    config = config if config is not None else tiny_config(model_type, vocab_size)
    model = generative_class(model_type).from_config(config)
    model.config.architectures = [type(model).__name__]
    return model


def _is_vision(key: str) -> bool:
    return any(w in key for w in ("vision", "visual", "image", "audio", "speech", "encoder"))


def shrink(raw: dict, vocab_size: int, *, vision: bool = False, text_hidden: int | None = None) -> dict:
    """A copy of a config dict with debug sizes (see module docstring).

    Args:
        text_hidden: the full-size decoder width, for a tower's widths that must match it.
    """
    out = dict(raw)
    table = _VISION if vision else _TEXT
    depth = "num_hidden_layers" if "num_hidden_layers" in raw or vision else "num_layers"
    old_layers = out.get(depth)  # LongCat-Flash names its depth num_layers
    if text_hidden is None:
        text_hidden = (raw.get("text_config") or {}).get("hidden_size") or raw.get("hidden_size")
    for key, value in raw.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out[key] = shrink(value, vocab_size, vision=vision or _is_vision(key), text_hidden=text_hidden)
        elif key in table and table[key] is not None and (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                or value is None and key == "head_dim"):  # None: derived, from full-size dims
            out[key] = table[key] if value != 0 else value  # 0 turns a part off (NoPE, no dense layer)
        elif not vision and _TOPK_LIKE.search(key) and key not in table and not key.startswith("index") \
                and isinstance(value, int) and not isinstance(value, bool) and value > TOP_K:
            out[key] = TOP_K
        elif key == "moe_intermediate_size" and isinstance(value, list):
            out[key] = [32, 16][: len(value)]
    if vision:
        _follow_widths(out, raw, text_hidden)
        for key, value in raw.items():  # per-layer lists of a tower follow its depth
            n = out.get("num_hidden_layers") or out.get("depth")
            old = raw.get("num_hidden_layers") or raw.get("depth")
            if isinstance(value, list) and isinstance(old, int) and len(value) == old and n:
                out[key] = value[:n]
            elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value) and n:
                out[key] = _keep_layers(value, n)
        return out
    for key, value in raw.items():  # every vocabulary-sized key follows the tiny vocabulary
        if key.endswith("vocab_size") and isinstance(value, int) and key != "vocab_size":
            out[key] = vocab_size
    for key in EXPERT_COUNT_KEYS:
        if isinstance(raw.get(key), int) and raw[key] > 0:
            out[key] = EXPERTS
            for flag in _MOE_SWITCHES:  # experts named but switched off: the tiny model is the MoE one
                if raw.get(flag) is False:
                    out[flag] = True
    for key in TOP_K_KEYS:
        if isinstance(raw.get(key), int) and raw[key] > 0:
            out[key] = min(TOP_K, raw[key])
        elif key == "num_experts_per_tok" and key in raw and raw[key] is None:
            out[key] = TOP_K  # the default config leaves it to the checkpoint
    if raw.get("num_key_value_heads") and raw.get("num_key_value_heads") == raw.get("num_attention_heads"):
        out["num_key_value_heads"] = HEADS  # the family requires MHA
    for key, value in raw.items():  # layer pattern periods: every second layer
        if key.endswith("_layer_period") and isinstance(value, int) and value > 1:
            out[key] = 2
        elif key.endswith("_layer_offset") and isinstance(value, int):
            out[key] = min(value, 1)
    if "vocab_size" in raw:
        out["vocab_size"] = vocab_size
        _clamp_token_ids(out, vocab_size)
    if isinstance(old_layers, int):
        out[depth] = LAYERS
        _cut_layer_lists(out, raw, old_layers)
    if out.get("kv_lora_rank") and "head_dim" in out:  # MLA: head_dim as the full-size one relates
        nope, rope = out.get("qk_nope_head_dim") or 0, out.get("qk_rope_head_dim") or HEAD_DIM
        raw_nope, raw_rope = raw.get("qk_nope_head_dim") or 0, raw.get("qk_rope_head_dim") or 0
        whole = bool(raw_nope) and raw.get("head_dim") == raw_nope + raw_rope
        out["head_dim"] = nope + rope if whole else rope  # q/k head (nope + rope), or the rotary part
    _fill_indexer(out)
    types = out.get("layer_types")
    # a window the checkpoint sets: the family has sliding layers (or sizes them, e.g.
    # num_sliding_attention_heads: its modeling code builds the sliding mask regardless)
    sliding = isinstance(types, list) and any("sliding" in str(t) for t in types) or any(
        "sliding" in k and k != "sliding_window" and isinstance(v, int) and not isinstance(v, bool)
        for k, v in raw.items())
    if "sliding_window" in out and out["sliding_window"] is None and sliding:
        out["sliding_window"] = _TEXT["sliding_window"]
    _fix_rope(out)
    return out


def _clamp_token_ids(out: dict, vocab_size: int) -> None:
    """Special token ids beyond the tiny vocabulary move to its top, distinct."""
    free = vocab_size - 1
    for key, value in sorted(out.items()):
        if (key.endswith(("_token_id", "_token_index", "_id")) and isinstance(value, int)
                and not isinstance(value, bool) and value >= vocab_size):
            out[key], free = free, free - 1


def _cut_layer_lists(out: dict, raw: dict, old_layers: int) -> None:
    """Per-layer lists keep LAYERS entries: the first one and the first sparse /
    attention one after it, so a tiny model still has each kind of layer."""
    for key, value in raw.items():
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            out[key] = {k: _shrink_override(v, raw, out) if isinstance(v, dict) else v
                        for k, v in _keep_layers(value, LAYERS).items()}
            continue
        if key not in _LAYER_LISTS and not (isinstance(value, list) and len(value) == old_layers):
            continue
        if isinstance(value, list) and len(value) == old_layers and old_layers > LAYERS:
            first = value[0]
            other = next((v for v in value[1:] if v != first), value[1])
            out[key] = [first, other]
        elif isinstance(value, str) and len(value) == old_layers:  # e.g. "M-M*-..."
            first = value[0]
            other = next((c for c in value[1:] if c != first), value[1])
            out[key] = first + other
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            kept = [v for v in value if v < LAYERS]
            if len(set(kept)) >= LAYERS and len(set(value)) < old_layers:
                kept = kept[:LAYERS - 1]  # the full-size list leaves layers out: so does the tiny one
            out[key] = kept or [LAYERS - 1]


def _follow_widths(out: dict, raw: dict, text_hidden: int | None) -> None:
    """A tower's other widths equal to its own or the decoder's full-size width (adapter
    input / output dims the configs check against them) follow the tiny one."""
    own = raw.get("hidden_size")
    for key, value in raw.items():
        if key in _VISION or not key.endswith(("_dim", "_size")) or isinstance(value, bool) \
                or not isinstance(value, int):
            continue
        if value == own and isinstance(out.get("hidden_size"), int):
            out[key] = out["hidden_size"]
        elif value == text_hidden:
            out[key] = HIDDEN


def _keep_layers(per_layer: dict, n: int) -> dict:
    """Per-layer entries of the first `n` layers; with none there, the first entry
    moves to the last tiny layer (so the tiny model keeps one such layer)."""
    kept = {k: v for k, v in per_layer.items() if int(k) < n}
    if not kept:
        first = next(iter(per_layer))
        kept = {type(first)(n - 1): per_layer[first]}
    return kept


_HEAD_DIMS = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim")


def _shrink_override(override: dict, raw: dict, tiny: dict) -> dict:
    """One layer's overrides of a heterogeneous config (`per_layer_config`) at debug
    sizes; where the full-size layer has head_dim = qk_nope_head_dim + qk_rope_head_dim,
    the tiny layer keeps it (its own head_dim, if the shared one does not add up)."""
    small = {k: v for k, v in shrink(override, 0).items() if k != "vocab_size"}
    full, merged = {**raw, **override}, {**tiny, **small}
    if all(isinstance(full.get(k), int) for k in _HEAD_DIMS) \
            and full["head_dim"] == full["qk_nope_head_dim"] + full["qk_rope_head_dim"] \
            and merged["head_dim"] != merged["qk_nope_head_dim"] + merged["qk_rope_head_dim"]:
        small["head_dim"] = merged["qk_nope_head_dim"] + merged["qk_rope_head_dim"]
    return small


# Indexer (DSA / QSA) sizes a default config may leave unset while its layer types ask
# for indexed attention; all are set together (the configs validate them as a group).
_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
            "indexer_budget": 16, "indexer_compress_ratio": 4}


def _fill_indexer(out: dict) -> None:
    if "indexed_attention" in (out.get("layer_types") or []) \
            and all(k in out and out[k] is None for k in _INDEXER):
        out.update(_INDEXER)


def _fill_layer_kinds(out: dict, config_cls) -> None:
    """Per-layer kind lists (`layer_types`, `mlp_layer_types`) that the default config
    leaves unset and does not derive (the checkpoint names them): one layer of each of
    the first two kinds the family's modeling code or config docstring names, from transformers' allowed
    layer types (dense before sparse, full attention before the others)."""
    for key, value in list(out.items()):
        if isinstance(value, dict) and key.endswith("_config"):
            sub = getattr(config_cls, "sub_configs", {}).get(key)
            if sub is not None:
                _fill_layer_kinds(value, sub)
        elif key.endswith("layer_types") and value is None and out.get("num_hidden_layers"):
            kinds = _layer_kinds(config_cls, mlp=key.startswith("mlp"))
            if kinds:
                n = out["num_hidden_layers"]
                out[key] = [kinds[min(i, len(kinds) - 1)] for i in range(n)]


def _modeling_source(config_cls) -> str:
    """The source of the family's modeling module ('' when there is none)."""

    try:
        module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
        return inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return ""


def _fill_mrope(out: dict, config_cls) -> None:
    """An M-RoPE split that the modeling code defaults (`rope_parameters.get("mrope_section",
    [8, 12, 12])`: transformers keeps it out of the config) is written into the decoder's
    rope parameters, so _fix_rope can cut it to the tiny head dim."""
    found = re.search(r"get\(\s*[\"']mrope_section[\"']\s*,\s*\[([\d,\s]+)\]", _modeling_source(config_cls))
    if not found:
        return
    default = [int(x) for x in found.group(1).split(",") if x.strip()]
    for target in [out] + [v for k, v in out.items() if isinstance(v, dict) and k.endswith("_config")
                           and not _is_vision(k)]:
        rope = target.get("rope_parameters")
        if isinstance(rope, dict) and "mrope_section" not in rope and "rope_theta" in rope \
                and target.get("num_attention_heads"):
            rope["mrope_section"] = list(default)
            _fix_rope(target)


_RECURRENT = ("linear_attention", "conv", "mamba")


def _keep_an_attention_layer(out: dict, config_cls) -> None:
    """A hybrid family whose default config has only recurrent layers (checkpoints mix in
    attention ones) keeps one full-attention layer, when its modeling code has that kind:
    transformers' caches cannot report a length without one (`get_seq_length`)."""
    for target in [out] + [v for k, v in out.items() if isinstance(v, dict) and k.endswith("_config")
                           and not _is_vision(k)]:
        types = target.get("layer_types")
        if isinstance(types, list) and len(types) > 1 and all(t in _RECURRENT for t in types) \
                and "full_attention" in _layer_kinds(config_cls, mlp=False, limit=None):
            target["layer_types"] = types[:-1] + ["full_attention"]


def _layer_kinds(config_cls, mlp: bool, limit: int | None = LAYERS) -> list[str]:
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import configuration_utils as cu

    allowed = cu.ALLOWED_MLP_LAYER_TYPES if mlp else cu.ALLOWED_ATTN_LAYER_TYPES
    text = _modeling_source(config_cls) + (config_cls.__doc__ or "")  # its docstring names kinds too
    named = set(re.findall(r"[\"']([a-z_]+)[\"']", text))
    kinds = [k for k in allowed if k in named]
    first = "dense" if mlp else "full_attention"
    return sorted(kinds, key=lambda k: k != first)[:limit]


def _fix_rope(out: dict) -> None:
    """M-RoPE sections must sum to half the (tiny) head dim."""
    rope = out.get("rope_parameters") or out.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        n = len(rope["mrope_section"])
        rotary = out.get("qk_rope_head_dim") or HEAD_DIM
        factor = rope.get("partial_rotary_factor") or out.get("partial_rotary_factor") or 1.0
        half = int(rotary * factor) // 2
        base = [half // n] * n
        base[0] += half - sum(base)
        rope["mrope_section"] = base


def moe_model_types() -> list[str]:
    """Every MoE model type of the installed transformers with a generative class:
    CONFIG_MAPPING entries whose default config (or its text config) names a
    routed-expert count, with a causal-LM or image-text class."""

    # lazy: transformers: heavy, loaded only when this runs
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            generative_class(model_type)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = CONFIG_MAPPING[model_type]()
        except Exception:  # no generative class, or a config that needs arguments
            continue
        try:
            text = cfg.get_text_config()
        except Exception:  # heterogeneous per-layer configs refuse a global text view
            text = cfg
        if any(isinstance(v := _get(c, k), int) and not isinstance(v, bool) and v > 0
               for c in (cfg, text) for k in EXPERT_COUNT_KEYS):
            out.append(model_type)
    return sorted(out)


def _get(cfg, key: str):
    try:
        return getattr(cfg, key, None)
    except Exception:  # per-layer attributes raise on a global read
        return None
