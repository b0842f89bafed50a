"""Model families, from transformers' own knowledge (no rename tables here).

For a checkpoint's config.json we build the family's transformers config and
model class on the `meta` device (no memory), and ask transformers for its
checkpoint conversion mapping (`get_model_conversion_mapping`, the same list
`from_pretrained` applies). The meta model's state dict is the runtime layout
we convert to; the mapping's renamings and converters are how source names
become runtime names. A new transformers MoE family with the same conventions
therefore works without new code here.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeflow.core.errors import UserError
from moeflow.model.anatomy import EXPERT_COUNT_KEYS, classify, meta_model

if TYPE_CHECKING:  # transformers is imported where a family is built (it is heavy)
    from transformers import PreTrainedConfig, PreTrainedModel



@dataclass
class Family:
    """A family resolved for one config: config object, meta model, conversions."""

    model_type: str
    architecture: str
    config: PreTrainedConfig
    meta: PreTrainedModel  # the model on the meta device
    renamings: list  # transformers WeightRenaming, in mapping order
    converters: list  # transformers WeightConverter, in mapping order

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Runtime state-dict name -> shape (what `from_pretrained` expects)."""
        return {k: tuple(v.shape) for k, v in self.meta.state_dict().items()}

    @functools.cached_property
    def meta_state(self) -> dict:
        return self.meta.state_dict()

    @property
    def base_model_prefix(self) -> str:
        return self.meta.base_model_prefix

    def optional_keys(self) -> set[str]:
        """Runtime keys a checkpoint may omit (tied weights)."""
        tied = getattr(self.meta, "all_tied_weights_keys", None) or {}
        return set(tied)

    def keeps_fp32(self, name: str, dtype: torch.dtype) -> bool:
        """True when transformers holds runtime tensor `name` in float32 in a
        model loaded in `dtype` (`_keep_in_fp32_modules_strict` for bf16 / fp16,
        `_keep_in_fp32_modules` for fp16), e.g. DeepSeek-V3's router weight and
        `e_score_correction_bias`; matched as `from_pretrained` matches them."""
        # lazy: transformers: heavy, loaded only when this runs
        from transformers.core_model_loading import build_glob_alternation

        plan = self.meta._get_dtype_plan(dtype)
        if not plan:
            return False
        alternation = build_glob_alternation(list(plan))[0]
        return bool(alternation.search(name))

    def ignorable_unexpected(self, key: str) -> bool:
        """Source keys transformers itself drops on load (e.g. DeepSeek-V3's MTP layer)."""
        patterns = getattr(self.meta, "_keys_to_ignore_on_load_unexpected", None) or []
        return any(re.search(p, key) for p in patterns)


def family_of(config: dict) -> str:
    """The `model_type` of a config dict (UserError when it has none)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UserError("config.json: no model_type")
    return model_type


def load_family(config: dict, where: str = "config.json") -> Family:
    """Resolve config.json to a transformers family on the meta device.

    Args:
        config: the parsed config.json dict.
        where: the file name used in error messages.

    Returns:
        A `Family`. Raises UserError for a family transformers does not know,
        remote code, or a model that is not a mixture of experts.
    """
    key = json.dumps(config, sort_keys=True)
    if key not in _CACHE:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _load(key, where)
    return _CACHE[key]


def _named_experts(cfg) -> int:
    """The routed-expert count the config names (0: none), text config included."""

    for c in (cfg, getattr(cfg, "text_config", None)):
        for key in EXPERT_COUNT_KEYS:
            value = getattr(c, key, None) if c is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


_CACHE: dict[str, Family] = {}  # config JSON -> Family (a meta model per process, reused)


def _load(config_json: str, where: str) -> Family:
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming


    raw = json.loads(config_json)
    model_type = family_of(raw)
    # the class by `architectures` (a model_type transformers does not know, e.g.
    # kimi_k2, is read with that class's config); `auto_map` remote code is ignored
    meta, cfg = meta_model(raw, where)
    arch = type(meta).__name__

    if not any(p.kind in ("experts", "vision_experts") and len(p.shape) == 3
               for p in classify(meta, cfg).params):
        named = _named_experts(cfg)
        raise UserError(f"{where}: {arch} ({model_type}) is not a mixture-of-experts model "
                        "(no fused routed-expert tensors in its module tree)" if not named else
                        f"{where}: {arch} ({model_type}): its {named} routed experts are not "
                        "fused [experts, ...] weight tensors in the module tree (moeflow converts, "
                        "plans and fine-tunes fused expert FFNs only)")
    conversions = get_model_conversion_mapping(meta, add_legacy=True)
    return Family(model_type, arch, cfg, meta,
                  [c for c in conversions if isinstance(c, WeightRenaming)],
                  [c for c in conversions if isinstance(c, WeightConverter)])
