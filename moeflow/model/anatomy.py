"""Model anatomy from transformers itself: the model class a config.json loads
as, built on the meta device (no memory, seconds even for a 2.8T model), and
every parameter classified by its role from the module tree.

Roles (`Param.kind`): embed, head, attention (any token mixer: attention, MLA,
linear attention, state-space), norm, dense_mlp, router, experts (routed),
vision_experts (routed experts only image tokens reach), shared_experts,
vision (tower), projector, other.

How a role is found, in this order (first match wins):
  - vision / projector: parameters outside the image-text class's language
    model (`moeflow.model.models.vision_parts`); projector when the module path
    names a merger / projector / resampler / adapter / connector;
  - embed / head: `get_input_embeddings()` / `get_output_embeddings()`;
  - shared_experts: under a module named shared_expert(s) / shared_mlp
    (its scalar gate, `shared_expert_gate`, is a router);
  - experts: under a module named `experts` (fused 3-D [E, ...] tensors or a
    per-expert ModuleList) or one whose class ends with `Experts`;
  - router: under a module named gate / router / gating, or whose class is a
    Router / Gate, or a routing bias (`e_score_correction_bias`);
  - attention: under a module whose class or name is an attention / token
    mixer (its norms, e.g. q_norm, included);
  - norm: a normalisation module (class name holds `Norm`);
  - dense_mlp: any other parameter of a decoder layer's MLP; other token
    mixer parameters of a decoder layer count as attention.
Decoder layers are the longest ModuleList of the language model.

    python -m moeflow.model.anatomy configs/models/deepseek-v3.json
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeflow.core.errors import UserError
from moeflow.model.remote_code import REGISTERED, activate

# config attributes that name the routed-expert count / top-k, across families
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_selected_experts")
_PROJECTOR = re.compile(r"(merger|projector|resampler|adapter|connector|mm_proj|aligner)", re.I)
_SHARED = ("shared_expert", "shared_experts", "shared_mlp", "shared_experts_mlp")
_ROUTER_LEAVES = ("gate", "router", "gating", "moe_gate", "shared_expert_gate", "gate_network")
_ROUTER_PARAMS = ("e_score_correction_bias", "expert_bias", "router_bias")
_ATTN_LEAVES = ("self_attn", "attention", "attn", "self_attention", "linear_attn", "mixer",
                "mamba", "conv", "token_mixer", "cross_attn")
_MLP_LEAVES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "feedforward")
VISION_EXPERTS = re.compile(r"(^|\.)vision_moe(\.|$)")


@dataclass(frozen=True)
class Param:
    """One parameter of the model as transformers holds it in memory."""

    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None  # decoder layer index; None outside the decoder layers
    module: str  # owning module's class name


@dataclass
class Anatomy:
    """A config resolved to its transformers class, with every parameter's role."""

    model_type: str
    architecture: str
    config: Any  # transformers PreTrainedConfig
    text_config: Any
    model: Any = field(repr=False)  # nn.Module on the meta device
    params: list[Param] = field(repr=False)
    layers_path: str  # name of the decoder ModuleList ("model.layers", ...)
    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    # router module names, layer order (ERNIE-VL's image-token routers included)
    routers: list[str] = field(default_factory=list)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.params:
            out[p.kind] = out.get(p.kind, 0) + _numel(p.shape)
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------ class resolution


def _attr(cfg, key: str):
    """A config attribute; None when absent or ambiguous (per-layer configs raise)."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # transformers' heterogeneous configs refuse global reads of per-layer keys
        return None


def resolve_class(raw: dict, where: str = "config.json"):
    """(model class, config class) transformers loads a config.json dict as.

    `architectures[0]` names the class when transformers has it; a `model_type`
    transformers does not know is then read with that class's own config class
    (Kimi-K2: model_type kimi_k2, DeepseekV3ForCausalLM). Without
    `architectures`, the model type's causal-LM class, or its image-text class
    when the config carries a vision_config. Remote code is never used.

    Raises:
        UserError: neither the architecture nor the model type is transformers'.
    """
    # lazy: transformers: heavy, loaded only when this runs
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )


    model_type = raw.get("model_type")
    if model_type in REGISTERED:  # a checkpoint's own code, checked and loaded (moeflow.model.remote_code)
        return REGISTERED[model_type]
    archs = raw.get("architectures") or []
    type_name = model_type if isinstance(model_type, str) else ""  # "" is no transformers type
    known_type = type_name in CONFIG_MAPPING
    arch = next((a for a in archs if isinstance(a, str) and hasattr(transformers, a)), None)
    if arch is None and known_type:
        clm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(type_name)
        itt = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(type_name)
        arch = (itt if raw.get("vision_config") is not None and itt else clm or itt)
    if arch is None:
        named = f"architectures {archs}" if archs else "no architectures"
        raise UserError(f"{where}: model_type {model_type!r} ({named}) is not a transformers "
                        "model class (remote code is never run)")
    model_cls = getattr(transformers, arch)
    config_cls = CONFIG_MAPPING[type_name] if known_type else model_cls.config_class
    return model_cls, config_cls


def _json_floats(value):
    """transformers writes non-finite floats into config.json as {"__float__": "Infinity"}
    (its to_json_string); read them back as floats, as from_pretrained does."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_floats(v) for v in value]
    return value


def build_config(raw: dict, where: str = "config.json"):
    """(model class, transformers config) of a config.json dict, quantisation and
    remote-code hooks (`auto_map`) left out."""
    model_cls, config_cls = resolve_class(raw, where)
    return model_cls, _from_dict(config_cls, raw, where)


def _from_dict(config_cls, raw: dict, where: str):
    clean = {k: _json_floats(v) for k, v in raw.items() if k not in ("quantization_config", "auto_map")}
    if clean.get("model_type") != getattr(config_cls, "model_type", None):
        # read as the class's own type (transformers keys its conversion mapping on it)
        clean.pop("model_type", None)
    try:
        return config_cls.from_dict(clean)
    except Exception as exc:  # noqa: BLE001 - TypeError/ValueError, or huggingface_hub's strict validation
        raise config_refused(exc, where, config_cls.__name__) from None


def config_refused(exc: BaseException, where: str, cls_name: str = "config class") -> UserError:
    """One line for a config.json value transformers' config class refuses, naming the key and
    value (huggingface_hub's strict validation says both over several lines)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return UserError(f"{where}: transformers' {cls_name} refuses this config: {text}")


def is_config_refusal(exc: BaseException) -> bool:
    """True for the strict-dataclass errors transformers' config classes raise on a bad value."""
    try:
        # lazy: huggingface_hub: optional dependency
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return False
    return isinstance(exc, StrictDataclassError)


def check_config_values(raw: dict, where: str = "config.json") -> None:
    """Refuse a config.json whose values transformers' config class rejects (one line, UserError).
    A model class transformers does not know is left to the command that needs one."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import CONFIG_MAPPING

    _check_counts(raw, where)
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING and model_type not in REGISTERED:
        # transformers' own type: its config class decides, as resolve_class would pick it; the
        # modeling module is not imported (seconds: `serve` checks before Ray starts)
        _from_dict(CONFIG_MAPPING[model_type], raw, where)
        return
    try:
        resolve_class(raw, where)
    except UserError:
        return
    build_config(raw, where)


def _check_counts(raw: dict, where: str) -> None:
    """Expert counts and top-k are integers: a config class that does not declare the key a
    family's config.json carries (Qwen3-MoE and `num_local_experts`) stores any value, and
    `"eight"` then reads as no experts at all."""
    for section, conf in (("", raw), ("text_config.", raw.get("text_config"))):
        if not isinstance(conf, dict):
            continue
        for key in (*EXPERT_COUNT_KEYS, *TOP_K_KEYS):
            value = conf.get(key)
            items = value if isinstance(value, list) else [value]
            if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
                raise UserError(f"{where}: {section}{key} is {value!r}, expected an integer")


def meta_model(raw: dict, where: str = "config.json"):
    """(model on the meta device, its config) for a config.json dict."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    model_cls, cfg = build_config(raw, where)
    try:
        with torch.device("meta"):
            if _text_part_only(raw, cfg):  # a package config without its vision_config
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_config(cfg)
            else:
                model = model_cls(cfg)
    except Exception as exc:  # the class itself rejects the config's values
        raise UserError(f"{where}: {model_cls.__name__} cannot be built from this config: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    return model, cfg


def _text_part_only(raw: dict, cfg) -> bool:
    """A multimodal package config (text_config) without vision_config describes
    its text model: transformers' causal-LM class for it, where there is one
    (the image-text class would build a default-size vision tower)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return ("text_config" in raw and "vision_config" not in raw
            and getattr(cfg, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


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


def source_config(model_dir: str | Path):
    """The transformers config of a checkpoint whose model_type transformers does not
    know (Kimi-K2), read with its architecture's config class; None otherwise (the
    checkpoint's own config.json loads as is). from_pretrained keys the checkpoint
    conversion mapping on the config's model_type, so the class's own is needed."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import CONFIG_MAPPING

    activate(model_dir)  # a checkpoint's own code: checked against its sha256 record, registered
    raw = load_config_json(model_dir)
    if raw.get("model_type") in CONFIG_MAPPING or not raw.get("architectures"):
        return None
    return build_config(raw, f"{model_dir}/config.json")[1]


# ------------------------------------------------------------ classification


def vision_parts(model) -> tuple[str, ...]:
    """Module names of an image-text model's parts beside its language model.

    The image-text classes hold `language_model` next to the vision tower and
    the projector / resampler (`model.visual`, `model.vision_tower`,
    `model.resampler_model`, ...); every sibling of `language_model` is a
    vision part. `lm_head` sits outside that container and stays language.
    Empty for a text model (no `language_model` submodule).
    """
    # named_modules is pre-order: the first hit is the outermost language model
    lm = next((n for n, _ in model.named_modules()
               if n.rpartition(".")[2] == "language_model"), None)
    if lm is None:
        return ()
    parent = lm.rpartition(".")[0]
    container = model.get_submodule(parent) if parent else model
    return tuple(f"{parent}.{c}" if parent else c for c, _ in container.named_children()
                 if c != "language_model")


def _language_prefixes(model) -> tuple[str, ...]:
    return vision_parts(model)


def _decoder_layers(model, vision: tuple[str, ...]) -> tuple[str, int]:
    """(name, length) of the longest ModuleList outside the vision parts."""
    # lazy: torch: heavy, loaded only when this runs
    from torch import nn

    best = ("", 0)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > best[1] and not _inside(name, vision) \
                and not re.search(r"(^|\.)experts$", name) and name.rpartition(".")[2] != "experts":
            best = (name, len(mod))
    return best


def _inside(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_chain(model, name: str) -> list[tuple[str, Any]]:
    """[(leaf name, module)] from the root to the parameter's owner."""
    out, mod = [], model
    for part in name.split(".")[:-1]:
        mod = getattr(mod, part)
        out.append((part, mod))
    return out


def _kind(name: str, chain, vision, embed_ids, head_ids, in_layer: bool) -> str:
    leaves = [leaf for leaf, _ in chain]
    classes = [type(m).__name__ for _, m in chain]
    pname = name.rpartition(".")[2]
    if _inside(name, vision):
        return "projector" if _PROJECTOR.search(name) else "vision"
    if chain and id(chain[-1][1]) in embed_ids:
        return "embed"
    if chain and id(chain[-1][1]) in head_ids:
        return "head"
    if "shared_expert_gate" in leaves:
        return "router"
    if any(leaf in _SHARED for leaf in leaves):
        return "shared_experts"
    experts_at = next((i for i, (leaf, cls) in enumerate(zip(leaves, classes))
                       if leaf == "experts" or cls.endswith("Experts")), None)
    if experts_at is not None and not any(c.endswith(("Attention", "Attn")) for c in classes[:experts_at]):
        return "vision_experts" if VISION_EXPERTS.search(name) else "experts"
    if pname in _ROUTER_PARAMS or any(leaf in _ROUTER_LEAVES for leaf in leaves[-2:]) or (
            classes and re.search(r"(Router|Gate|Gating)$",
                                  classes[-2 if len(classes) > 1 and classes[-1] == "Linear" else -1])):
        return "router"
    if any(leaf in _ATTN_LEAVES or re.search(r"(Attention|Attn|Mamba|Mixer|DeltaNet|Conv)", cls)
           for leaf, cls in zip(leaves, classes)):
        return "attention"
    if classes and "Norm" in classes[-1]:
        return "norm"
    if in_layer and (experts_at is not None or any(leaf in _MLP_LEAVES for leaf in leaves)
                     or any(re.search(r"(MLP|FeedForward|Moe|MoE|Sparse)", c) for c in classes)):
        return "dense_mlp"
    return "attention" if in_layer else "other"


def _config_int(cfgs, keys) -> int:
    for cfg in cfgs:
        for k in keys:
            v = _attr(cfg, k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return 0


def classify(model, config) -> Anatomy:
    """Every parameter of a (meta) model with its role, layer and owner class."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vision = _language_prefixes(model)
    layers_path, n_layers = _decoder_layers(model, vision)
    emb, head = model.get_input_embeddings(), None
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        pass
    embed_ids = {id(emb)} if emb is not None else set()
    head_ids = {id(head)} if head is not None else set()
    layer_re = re.compile(rf"^{re.escape(layers_path)}\.(\d+)\.") if layers_path else None
    params, expert_layers, expert_counts = [], set(), []
    for name, p in model.named_parameters():
        m = layer_re.match(name) if layer_re else None
        layer = int(m.group(1)) if m else None
        chain = _module_chain(model, name)
        kind = _kind(name, chain, vision, embed_ids, head_ids, layer is not None)
        params.append(Param(name, tuple(p.shape), kind, layer, type(chain[-1][1]).__name__
                            if chain else type(model).__name__))
        if kind == "experts" and layer is not None:
            expert_layers.add(layer)
            if p.dim() == 3:
                expert_counts.append(p.shape[0])
            elif (e := re.search(r"\.experts\.(\d+)\.", name)):
                expert_counts.append(int(e.group(1)) + 1)
    num_experts = _config_int((text, config), EXPERT_COUNT_KEYS) or max(expert_counts, default=0)
    top_k = _config_int((text, config), TOP_K_KEYS) or _module_top_k(model) or (1 if num_experts else 0)
    return Anatomy(model_type=str(_attr(config, "model_type") or ""),
                   architecture=type(model).__name__, config=config, text_config=text,
                   model=model, params=params, layers_path=layers_path, num_layers=n_layers,
                   num_experts=num_experts, top_k=top_k, moe_layers=tuple(sorted(expert_layers)),
                   routers=router_names(model, vision))


def _module_top_k(model) -> int:
    for _, mod in model.named_modules():
        for k in ("top_k", "num_experts_per_tok", "topk"):
            v = getattr(mod, k, None)
            if isinstance(v, int) and v > 0:
                return v
    return 0


def router_names(model, vision: tuple[str, ...] = ()) -> list[str]:
    """Modules that route tokens to experts: a gate / router sibling of an
    `experts` container, or a module whose class is a Router (language model only)."""
    out: list[str] = []
    for name, mod in model.named_modules():
        if not name or _inside(name, vision):
            continue
        parent, _, leaf = name.rpartition(".")
        try:
            sibling = model.get_submodule(f"{parent}.experts") if parent else None
        except AttributeError:
            sibling = None
        is_router = re.search(r"(Router|Gating)$", type(mod).__name__) or (
            leaf in ("gate", "router", "gating") and sibling is not None)
        if is_router and ".base_layer" not in name and not name.endswith(".experts"):
            if not any(name.startswith(r + ".") for r in out):
                out.append(name)
    return out


@functools.lru_cache(maxsize=16)
def _anatomy_cached(config_json: str, where: str) -> Anatomy:
    raw = json.loads(config_json)
    model, cfg = meta_model(raw, where)
    return classify(model, cfg)


def anatomy(raw: dict, where: str = "config.json", *, require_moe: bool = True) -> Anatomy:
    """The anatomy of a config.json dict (cached per config).

    Raises:
        UserError: not a transformers class, or (require_moe) no routed experts.
    """
    if not isinstance(raw.get("model_type"), str):
        raise UserError(f"{where}: config.json has no `model_type`")
    an = _anatomy_cached(json.dumps(raw, sort_keys=True), where)
    if require_moe and not any(p.kind in ("experts", "vision_experts") for p in an.params):
        raise UserError(f"{where}: {an.architecture} ({raw['model_type']}) is not a "
                        "mixture-of-experts model (no routed experts in its module tree)")
    return an


def from_model(model) -> Anatomy:
    """The anatomy of an already built (or loaded) model."""
    return classify(model, model.config)


if __name__ == "__main__":  # pragma: no cover - a debugging aid
    import sys

    an = anatomy(load_config_json(sys.argv[1]), sys.argv[1])
    print(an.architecture, an.num_layers, "layers,", an.num_experts, "experts, top", an.top_k)
    for kind, n in sorted(an.by_kind().items()):
        print(f"  {kind:15s} {n:,}")
