"""Per-row LoRA for mixed-adapter batches (Punica/S-LoRA's gather + batched matmul).

Why hand-written: PEFT's mixed-batch path (`adapter_names=`) loops over the
adapters present in every LoRA layer and re-registers hooks on every call,
so a batch spread over 4 adapters costs several times one adapter; PEFT's
`disable_adapter()` for base rows also walks the whole module tree each step.
Here each PEFT `lora.Linear`'s forward is replaced (on the instance) by one
that runs its base layer and adds the LoRA delta of each row's adapter:

    delta[b] = (x[b] @ A'[s_b]) @ B'[s_b]     s_b = adapter slot of row b
    A' = A^T [S, I, R],  B' = scale * B^T [S, R, O]   (transposed, scale folded in, once)

Slot 0 is "no adapter" (zero weights), ranks are zero-padded to the largest.
What a step costs is mostly per-module dispatch on a small model, so the work
per module is kept to two matmuls and an add: the rows' slots are gathered
once per forward for all modules of one shape (`rows`' setter: one
`index_select` per shape group, not two per module), a batch whose rows all
use one adapter multiplies by its weights without a gather, and a batch of
base rows only adds nothing. (Profiled on the demo model, 16 rows of 16
adapters: the PEFT forward wrapper, the forward hook and the per-module
gathers and scale took more than the two matmuls.)
Only plain LoRA on Linear modules qualifies; expert LoRA (`ParamWrapper`),
DoRA or LoRA on embeddings use PEFT's own per-adapter forwards instead.

Axis legend: B rows, C tokens per row, I in features, O out features, R rank,
S slots (adapters + 1), M modules of one shape group.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

Weights = tuple[torch.Tensor, torch.Tensor, float]  # LoRA A [R, I], B [O, R], scale


def supported(peft_model) -> bool:
    """True when every LoRA layer is a plain `lora.Linear` without variants (DoRA, ...)."""
    # lazy: peft: heavy, loaded only when this runs
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear

    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            if type(module) is not Linear or module.lora_variant or module.lora_magnitude_vector:
                return False
    return True


class BatchedLora:
    """Stacks of the resident adapters' LoRA weights and the forwards that apply them
    (built by `over_peft` or `over_base`).

    Args:
        layers: (module whose forward is taken over, the call computing its base output,
            {adapter: its weights there}) per LoRA-targeted module.
        names: adapter names, in slot order (slot i + 1).
        peft: the modules are PEFT's `lora.Linear` layers (their own LoRA path is turned off).
    """

    def __init__(self, layers: list[tuple[Any, Any, dict[str, Weights]]], names: list[str], peft: bool):
        self.slot = {name: i + 1 for i, name in enumerate(names)}
        self._rows: torch.Tensor | None = None  # [B] slot per row while a forward runs
        self._uniform: int | None = None  # the one slot of every row, if they share one
        self._peft = peft
        self._taken: list = []
        groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        where: list[tuple[Any, Any, tuple, int]] = []  # (module, its base call, its group, its index there)
        for module, call, weights in layers:
            a, b = self._stack(module_weight(module), weights, names)
            key = (tuple(a.shape), tuple(b.shape), a.dtype, a.device)
            group = groups.setdefault(key, [])
            where.append((module, call, key, len(group)))
            group.append((a, b))
        # per shape group: [M, S, I, R] and [M, S, R, O]; a forward gathers its rows' slots once
        self._stacks = {key: (torch.stack([a for a, _ in g]), torch.stack([b for _, b in g]))
                        for key, g in groups.items()}
        self._gathered: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, call, key, j in where:
            if peft:
                module.enable_adapters(False)  # PEFT's own LoRA path off (as a fallback it adds nothing)
            module.forward = self._forward(call, key, j)
            self._taken.append(module)

    @classmethod
    def over_peft(cls, peft_model, names: list[str]) -> "BatchedLora":
        """Over a PeftModel's `lora.Linear` layers (adapters loaded by PEFT)."""
        # lazy: peft: heavy, loaded only when this runs
        from peft.tuners.lora.layer import Linear

        layers: list[tuple[Any, Any, dict[str, Any]]] = []  # PEFT types its weights as Tensor | Module
        for module in peft_model.modules():
            if isinstance(module, Linear):
                weights = {n: (module.lora_A[n].weight, module.lora_B[n].weight, float(module.scaling[n]))
                           for n in names if n in module.lora_A}
                layers.append((module, module.get_base_layer(), weights))
        return cls(layers, names, peft=True)

    @classmethod
    def over_base(cls, model, adapters: dict[str, dict[str, Weights]]) -> "BatchedLora":
        """Straight over the base model's Linear modules (`direct_weights`: no PEFT layers)."""
        modules = dict(model.named_modules())
        names = list(adapters)
        targets = dict.fromkeys(t for w in adapters.values() for t in w)
        layers = []
        for target in targets:
            module = modules[target]
            weights = {n: adapters[n][target] for n in names if target in adapters[n]}
            layers.append((module, functools.partial(type(module).forward, module), weights))
        return cls(layers, names, peft=False)

    @property
    def rows(self) -> torch.Tensor | None:
        return self._rows

    @rows.setter
    def rows(self, rows: torch.Tensor | None) -> None:
        """Set before a forward ([B] slot per row), None after it: gathers the rows' weights."""
        self._rows, self._gathered, self._uniform = rows, {}, None
        if rows is None:
            return
        first = int(rows[0])
        if bool((rows == first).all()):
            self._uniform = first
            return
        self._gathered = {key: (a.index_select(1, rows), b.index_select(1, rows))  # [M, B, I, R], [M, B, R, O]
                          for key, (a, b) in self._stacks.items()}

    @staticmethod
    def _stack(base: torch.Tensor, weights: dict[str, Weights], names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """A' [S, I, R] and B' [S, R, O] (transposed, the scale folded into B'), on the base
        weight's device and dtype (a copy of each adapter's weights)."""
        rank = max((a.shape[0] for a, _, _ in weights.values()), default=1)
        a_all = base.new_zeros(len(names) + 1, base.shape[1], rank)  # [S, I, R]
        b_all = base.new_zeros(len(names) + 1, rank, base.shape[0])  # [S, R, O]
        for i, name in enumerate(names, start=1):
            if name in weights:
                a, b, scale = weights[name]
                r = a.shape[0]
                a_all[i, :, :r] = a.T
                b_all[i, :r] = b.T * scale
        return a_all, b_all

    def _forward(self, base_layer, key: tuple, j: int):
        stack_a, stack_b = self._stacks[key]
        a_all, b_all = stack_a[j], stack_b[j]  # [S, I, R], [S, R, O]

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            out = base_layer(x, *args, **kwargs)
            rows = self._rows
            if rows is None:
                return out
            s = self._uniform
            if s is not None:  # every row one adapter (or none): no gather
                if s == 0:
                    return out
                delta = (x.to(a_all.dtype) @ a_all[s]) @ b_all[s]  # [..., O]
                return out + delta.to(out.dtype)
            if x.dim() != 3 or x.shape[0] != rows.shape[0]:
                # not per-row (a vision tower's [patches, I] during one sequence's prefill) with
                # rows of several adapters: no row-to-token map to apply them by
                raise RuntimeError(f"LoRA input of shape {tuple(x.shape)} in a {rows.shape[0]}-row batch")
            a, b = self._gathered[key]
            h = torch.bmm(x.to(a.dtype), a[j])  # [B, C, R]
            return out + torch.bmm(h, b[j]).to(out.dtype)  # [B, C, O]
        return forward

    def close(self) -> None:
        """Give the layers back (their class's forward; PEFT's layers their adapters enabled)."""
        for module in self._taken:
            del module.forward  # the instance attribute: the class's forward again
            if self._peft:
                module.enable_adapters(True)
        self._taken = []
        self._stacks, self._gathered = {}, {}


def module_weight(module) -> torch.Tensor:
    """The weight [O, I] of a Linear (under PEFT's wrapper, its base layer's)."""
    return (module.get_base_layer() if hasattr(module, "get_base_layer") else module).weight


# keys of a LoRA adapter_config that change what its tensors compute beyond
# scale * B @ A on Linear modules (PEFT's LoraConfig): such an adapter goes through PEFT
_VARIANTS = ("use_dora", "target_parameters", "rank_pattern", "alpha_pattern", "modules_to_save",
             "layer_replication", "lora_bias", "trainable_token_indices", "use_qalora", "alora_invocation_tokens",
             "arrow_config", "megatron_config")


def direct_weights(config: dict, tensors: dict[str, torch.Tensor], model) -> dict[str, Weights] | None:
    """{module name: (A [R, I], B [O, R], scale)} of a plain LoRA adapter on Linear modules,
    from its adapter_config and tensors, for `BatchedLora.over_base`; None when it needs PEFT
    (a variant, a pattern of ranks, a target that is not a Linear, other tensors).

    The scale is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
    """
    if any(config.get(k) for k in _VARIANTS):
        return None
    r, alpha = int(config.get("r") or 0), float(config.get("lora_alpha") or 0)
    if r <= 0:
        return None
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    modules = dict(model.named_modules())
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for half in ("lora_A", "lora_B"):
            if key.endswith(f".{half}.weight"):
                target = key[: -len(f".{half}.weight")].removeprefix("base_model.model.")
                halves.setdefault(target, {})[half] = tensor
                break
        else:
            return None  # a tensor other than plain LoRA's
    out: dict[str, Weights] = {}
    for target, pair in halves.items():
        module = modules.get(target)
        if type(module) is not torch.nn.Linear or set(pair) != {"lora_A", "lora_B"} or pair["lora_A"].shape[0] != r:
            return None
        out[target] = (pair["lora_A"], pair["lora_B"], scale)
    return out or None
