"""LoRA targets: aliases resolved by role (moeflow.model.anatomy) against the real module tree.

Aliases (LoraSection.target_modules):
  attention       q/k/v/o projections, or the MLA projections of DeepSeek-style
                  attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
                  o_proj) where q_proj does not exist
  experts         fused routed-expert tensors (experts.gate_up_proj/down_proj)
                  through PEFT `target_parameters` (rank r per expert); on
                  ERNIE-4.5-VL the TEXT experts only (mlp.text_moe): text tokens
                  never route to its vision experts (mlp.vision_moe), so
                  adapting them on text data trains nothing
  shared_experts  linear layers of the always-on shared expert(s)
  router          the MoE gate (a Linear, or a bare weight -> target_parameters);
                  on ERNIE-4.5-VL the text router (mlp.text_moe.gate) only
Anything else is a module leaf name (PEFT suffix match) or a parameter suffix
(an explicit `vision_moe.experts.gate_up_proj` does reach ERNIE's vision experts).

Every request must match something, or we refuse before training and list
what exists: expert LoRA silently applying to nothing is a known failure of
other tools. On an image-text model (Qwen3-VL-MoE, ERNIE-4.5-VL, loaded by
moeflow.model.models) nothing outside the language model ever matches — no alias,
no name, no parameter suffix: the vision tower has its own attention
(`attn.qkv` / `attn.proj`, Llama-4's q_proj) and MLPs, and the projector /
resampler sits beside it (`moeflow.model.models.vision_parts`).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import TYPE_CHECKING

from torch import nn

from moeflow.core.config import LoraSection
from moeflow.core.errors import UserError
from moeflow.model.anatomy import from_model, vision_parts

if TYPE_CHECKING:  # types only: peft loads when a model is wrapped
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

ALIASES = ("attention", "experts", "shared_experts", "router")
VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision)(\.|$)")
# ERNIE-4.5-VL's per-modality expert blocks: text tokens use text_moe only
VISION_EXPERTS = re.compile(r"(^|\.)vision_moe(\.|$)")


@dataclass
class Targets:
    """Resolved LoRA targets, ready for `peft.LoraConfig`."""

    modules: list[str] = field(default_factory=list)  # full module names (relative to model)
    parameters: list[str] = field(default_factory=list)  # PEFT target_parameters suffixes
    matched: dict[str, list[str]] = field(default_factory=dict)  # request -> what it hit

    def module_regex(self) -> str | None:
        """One full-match regex over the module names, layer indices generalised.

        `model.layers.0.self_attn.q_proj` becomes `model\\.layers\\.\\d+\\.self_attn\\.q_proj`,
        so adapter_config.json stays short for a 61-layer model.
        """
        pats = sorted({r"\.".join(r"\d+" if part.isdigit() else re.escape(part)
                                   for part in name.split(".")) for name in self.modules})
        return f"^(?:{'|'.join(pats)})$" if pats else None


def language_filter(model: nn.Module):
    """A predicate on module / parameter names of `model`: True inside its language model."""

    parts = vision_parts(model)

    def is_language(name: str) -> bool:
        return not VISION.search(name) and not any(name == p or name.startswith(p + ".")
                                                   for p in parts)
    return is_language


def _language_modules(model: nn.Module):
    is_language = language_filter(model)
    for name, mod in model.named_modules():
        if name and is_language(name):
            yield name, mod


def _roles(model: nn.Module) -> dict[str, str]:
    """Parameter name -> role (moeflow.model.anatomy) for every parameter of `model`."""

    return {p.name: p.kind for p in from_model(model).params}


_ALIAS_KINDS = {"attention": ("attention",), "experts": ("experts",),
                "shared_experts": ("shared_experts",), "router": ("router",)}


def _match_alias(model: PreTrainedModel, alias: str) -> tuple[list[str], list[str]]:
    """(module names, parameter suffixes) an alias hits in `model`.

    The role of each parameter comes from moeflow.model.anatomy (the module tree):
    Linear modules of that role are LoRA modules; >= 2-D parameters of that
    role held directly by a non-Linear module (fused 3-D experts, a bare
    router weight) are PEFT `target_parameters`, named by their last three
    name parts (`mlp.experts.gate_up_proj`). ERNIE-VL's image-token experts
    (role vision_experts) are never hit: text data never reaches them.
    """
    kinds = _ALIAS_KINDS[alias]
    roles = _roles(model)
    remapped = _peft_remapped_leaves(model) if alias in ("attention", "shared_experts") else set()
    mods: list[str] = []
    params: list[str] = []
    skipped: list[str] = []  # leaves PEFT would take for expert projections
    for name, mod in _language_modules(model):
        own = [(f"{name}.{pn}", p) for pn, p in mod.named_parameters(recurse=False)]
        hit = [(n, p) for n, p in own if roles.get(n) in kinds]
        if not hit:
            continue
        # a Linear subclass with its own forward (a grouped projection, Llama4's router that
        # returns (scores, logits)) is not a LoRA module: its weight may be a target parameter
        if plain_linear(mod):
            if alias == "attention" and not _in_attention(model, name):
                continue  # a state-space / conv token mixer: PEFT refuses LoRA there
            if any(n.endswith(".weight") for n, _ in hit):
                (skipped if name.rpartition(".")[2] in remapped else mods).append(name)
            continue
        for n, p in hit:
            # a router's weight only: its routing bias (e_score_correction_bias) is not a matmul
            if p.ndim >= 2 and (alias == "experts" or alias == "router" and n.endswith(".weight")) \
                    and not VISION_EXPERTS.search(n):
                params.append(".".join(n.split(".")[-3:]))
    if skipped and not mods and not params:
        raise UserError(f"lora.target_modules: {alias!r} hits only {skipped[0]} (and "
                        f"{len(skipped) - 1} more), which PEFT {_peft_version()} renames to "
                        f"fused routed-expert tensors for model_type {model.config.model_type!r}; "
                        "target the experts alias or other module names instead")
    return mods, sorted(set(params))


def _peft_remapped_leaves(model: nn.Module) -> set[str]:
    """Module leaf names PEFT rewrites to fused expert tensors for this model.

    PEFT 0.21 converts targets of models whose transformers conversion pattern
    is a v4 MoE layout (`_MOE_TARGET_MODULE_MAPPING`, e.g. qwen2_moe's
    gate_proj / up_proj -> experts.gate_up_proj) by leaf name alone, so an
    attention output gate named `gate_proj` (AFMoE, Beam) would be taken for
    an expert projection and refused. Such leaves are left out of the
    non-expert aliases; PEFT's own tables are the handle, no family list here.
    """
    try:
        # lazy: peft: optional dependency
        from peft.utils import transformers_weight_conversion as conv
    except ImportError:
        return set()
    pattern = getattr(conv, "_MODEL_TO_CONVERSION_PATTERN", {}).get(getattr(model.config, "model_type", None))
    return set(getattr(conv, "_MOE_TARGET_MODULE_MAPPING", {}).get(pattern, {}) or ())


def plain_linear(mod: nn.Module) -> bool:
    """An nn.Linear whose forward is Linear's: PEFT's LoRA adds x @ A.T @ B.T to it.
    A subclass with its own forward (DeepSeek-V4's block-diagonal grouped output
    projection) maps other shapes, and a LoRA delta of the Linear's shape would not fit."""
    return isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward


def _in_attention(model: nn.Module, name: str) -> bool:
    """True when a module sits inside an attention module (its class names
    attention), not a Mamba / linear-attention mixer of a hybrid model."""
    parts = name.split(".")
    # MLA: LongCat-Flash's attention class is `LongcatFlashMLA`
    return any(re.search(r"(Attention|Attn|MLA)", type(model.get_submodule(".".join(parts[:i]))).__name__)
               for i in range(1, len(parts)))


def _peft_version() -> str:
    return version("peft")


def available(model: nn.Module) -> tuple[list[str], list[str]]:
    """What could be targeted: Linear leaf names and >=2-D parameter suffixes."""
    is_language = language_filter(model)
    leaves = sorted({n.rpartition(".")[2] for n, m in _language_modules(model)
                     if plain_linear(m)})
    params = sorted({".".join(n.split(".")[-3:]) for n, p in model.named_parameters()
                     if p.ndim >= 2 and is_language(n) and not n.endswith("proj.weight")
                     and "embed" not in n and "lm_head" not in n})
    return leaves, params


def resolve_targets(model: PreTrainedModel, requested: list[str]) -> Targets:
    """Resolve aliases and names against `model`.

    Args:
        model: the (unwrapped) transformers model.
        requested: LoraSection.target_modules.

    Returns:
        Targets (module names and parameter suffixes), with what each request hit.

    Raises:
        UserError: a request matches nothing; the message lists what exists.
    """
    out = Targets()
    leaves, params = available(model)
    is_language = language_filter(model)
    for req in requested:
        if req in ALIASES:
            mods, pars = _match_alias(model, req)
        else:
            mods = [n for n, m in _language_modules(model)
                    if plain_linear(m) and (n == req or n.endswith("." + req))]
            pars = sorted({req} if any(n == req or n.endswith("." + req)
                                       for n, p in model.named_parameters() if p.ndim >= 2)
                          else set())
        # PEFT applies a parameter suffix wherever it matches: never inside the vision parts
        outside = [n for n, p in model.named_parameters() for s in pars
                   if (n == s or n.endswith("." + s)) and not is_language(n)]
        if outside:
            raise UserError(f"lora.target_modules: {req!r} matches vision-tower parameters "
                            f"({', '.join(outside[:3])}); LoRA adapts the language model only, "
                            "give a longer suffix")
        # a packed base (moeflow.model.packed_base.load_packed marks it): its experts' weights are not
        # parameters, and the alias would hit what is left of them (GPT-OSS's biases)
        if req == "experts" and getattr(model, "_moeflow_packed", None):
            raise UserError("lora.target_modules: 'experts' cannot be targeted on a base kept "
                            "quantised (convert.dtype keep): its routed experts are packed, not "
                            "parameters; target attention, shared_experts or router, or convert "
                            "with dtype bf16")
        if not mods and not pars:
            raise UserError(
                f"lora.target_modules: {req!r} matches nothing in {type(model).__name__}; "
                f"aliases: {', '.join(ALIASES)}; linear modules: {', '.join(leaves)}; "
                f"parameters: {', '.join(params) or 'none'}")
        out.matched[req] = mods + pars
        out.modules += [m for m in mods if m not in out.modules]
        out.parameters += [p for p in pars if p not in out.parameters]
    return out


def lora_config(targets: Targets, lora_cfg: LoraSection) -> LoraConfig:
    """Build the `peft.LoraConfig`.

    Raises:
        UserError: dropout with parameter targets (PEFT's ParamWrapper refuses it).
    """
    # lazy: peft: heavy, loaded only when this runs
    from peft import LoraConfig

    if targets.parameters and lora_cfg.dropout:
        raise UserError(f"lora.dropout={lora_cfg.dropout}: LoRA on expert/router tensors "
                        f"({', '.join(targets.parameters)}) does not support dropout in "
                        "PEFT; set lora.dropout: 0")
    # lora_alpha: PEFT annotates an int, and divides it by r as a float alike (lora.alpha: float)
    return LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha,  # type: ignore[arg-type]
                      lora_dropout=lora_cfg.dropout,
                      target_modules=targets.module_regex() or [],
                      target_parameters=targets.parameters or None,
                      bias="none", task_type="CAUSAL_LM")


@contextmanager
def _tp_hidden_from_peft(model: nn.Module):
    """PEFT's own TP integration off while it wraps `model`: LoRA layers are made whole, then
    moeflow.training.tp_lora.shard_lora cuts them (call it next). PEFT's integration hooks the
    Linear LoRA layers moeflow replaces anyway, and fails on expert LoRA (ParamWrapper: no
    `.weight`); it finds the TP mesh on the model's `_device_mesh`."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or getattr(getattr(model.config, "distributed_config", None), "tp_size", 1) <= 1:
        yield
        return
    model._device_mesh = None  # type: ignore[assignment]  # transformers' own default
    try:
        yield
    finally:
        model._device_mesh = mesh


def apply_lora(model: PreTrainedModel, lora_cfg: LoraSection) -> tuple[PeftModel, Targets, dict[str, float]]:
    """Freeze the base, wrap it with LoRA, and check only LoRA trains.

    Returns:
        (peft model, targets, {"trainable_params", "total_params", "trainable_pct",
         "lora_bytes", "base_bytes"}).
    """
    import torch
    from peft import get_peft_model

    from moeflow.model.split_lora import enable_split_lora  # imports peft: heavy, only when wrapping
    from moeflow.training.tp_lora import init_by_name

    targets = resolve_targets(model, list(lora_cfg.target_modules))
    for p in model.parameters():
        p.requires_grad_(False)
    with _tp_hidden_from_peft(model):
        peft_model = get_peft_model(model, lora_config(targets, lora_cfg))
    # the run's seed (set just before) and each module's name fix its start, whatever the
    # parallel layout: a TP or CP run starts from the single-process adapter (tp_lora)
    init_by_name(peft_model, torch.initial_seed())
    if targets.parameters:  # expert LoRA computes split when the experts run SPLIT_IMPL
        enable_split_lora(peft_model)
    trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    bad = [n for n, _ in trainable if "lora_" not in n]
    if bad or not trainable:
        raise RuntimeError(f"base not frozen / nothing trainable: {bad[:5]}")
    n_train = sum(p.numel() for _, p in trainable)
    n_total = sum(p.numel() for p in peft_model.parameters())
    return peft_model, targets, {
        "trainable_params": n_train, "total_params": n_total,
        "trainable_pct": 100.0 * n_train / n_total,
        "lora_bytes": sum(p.numel() * p.element_size() for _, p in trainable),
        "base_bytes": sum(p.numel() * p.element_size() for p in peft_model.parameters()
                          if not p.requires_grad)}
