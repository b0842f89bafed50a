"""Split expert LoRA: `x·A` then `·B` per expert through grouped GEMMs, never the delta weight.

PEFT adapts fused expert tensors (`target_parameters`, e.g. `experts.gate_up_proj`
[E, 2I, H]) by re-parametrising the parameter: every forward folds `W + s·B·A` into a
new [E, 2I, H] tensor (one `baddbmm`), and the backward then computes the gradient of
that whole tensor before it reaches A and B. At rank r that is two extra GEMMs of the
size of all experts' weights per step, whatever the number of tokens — at the
reference model's 896 experts the largest tensor of a step. The fastest MoE
fine-tuning stacks instead apply the adapter as activations: for the tokens routed to
expert e, `y = x·W_e + s·(x·A_e)·B_e`, two small grouped GEMMs of rank r.

This module does that without replacing PEFT or transformers:
- `split_lora_experts_forward` is an experts implementation registered in
  transformers' `ExpertsInterface` under `SPLIT_IMPL` (selected like grouped_mm, with
  `model.set_experts_implementation`). Without an active adapter it is transformers'
  own grouped_mm forward; with one, the same grouped GEMMs plus the low-rank terms.
- `SplitParamWrapper` is PEFT's `ParamWrapper` (the same parameters, so adapters save
  and load in PEFT's own format) whose activation hands the factors to the experts
  module instead of re-parametrising the weight — only when that module computes with
  `SPLIT_IMPL` and one adapter is active; otherwise PEFT's path runs unchanged, so an
  adapter is never silently skipped.

Axis letters: T tokens, k top-k, S = T·k routed pairs, E experts, H hidden,
I expert intermediate, r LoRA rank, in/out a projection's input/output width.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from peft.tuners.lora.layer import ParamWrapper
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from moeflow.model.grouped_gemm import grouped_linear, grouped_mm

SPLIT_IMPL = "split_lora"
_FACTORS = "_moeflow_split_lora"  # attribute on the experts module: {param name: (P, Q, scale, fn)}
# attribute on a SplitParamWrapper: its low-rank product when that is not the plain one
# (tensor-parallel experts add collectives: moeflow.training.tp_lora)
LOW_RANK = "_moeflow_low_rank"


def grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x·W_e per expert group: x [S, in] grouped by expert, w [E, in, out] -> [S, out]."""
    return grouped_mm(x, w, offsets)


def _low_rank(x: torch.Tensor, factors, offsets: torch.Tensor) -> torch.Tensor:
    """s·(x·P)·Q per expert group: x [S, in], P [E, in, r], Q [E, r, out] -> [S, out]."""
    p, q, scale, fn = factors
    if fn is not None:
        return fn(x, p, q, scale, offsets)
    return grouped(grouped(x, p, offsets), q, offsets) * scale


def split_lora_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward with the active LoRA added per expert group.

    Same routing, sorting, EP sentinel handling, biases, gating and post-norm as
    transformers' `grouped_mm_experts_forward` (with no adapter active, the same forward);
    only the two projections gain `+ s·(x·A_e)·B_e`. Its GEMMs also compile on CPU in float32
    (moeflow/model/grouped_gemm.py), which is why compiled serving computes with it.
    """
    factors = getattr(self, _FACTORS, None) or {}
    device = hidden_states.device
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.size(0), hidden_states.size(-1)
    sample_weights = top_k_weights.reshape(-1)  # [S]
    expert_ids = top_k_index.reshape(-1)  # [S]
    expert_ids_g, perm = torch.sort(expert_ids)
    x = hidden_states[perm // num_top_k]  # [S, H], grouped by expert
    weights_g = sample_weights[perm]  # [S]
    counts_in = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(counts_in, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)  # [E]
    sentinel = None
    if self._is_expert_parallel:  # ids of experts on other ranks sort to the tail; the GEMMs skip them
        sentinel = (expert_ids_g >= self.num_experts).unsqueeze(-1)
        expert_ids_g = expert_ids_g.clamp(max=self.num_experts - 1)
        x = x.masked_fill(sentinel, 0.0)

    up_name = "gate_up_proj" if self.has_gate else "up_proj"
    up_bias = getattr(self, f"{up_name}_bias")[expert_ids_g] if self.has_bias else None
    h = grouped_linear(x, getattr(self, up_name), offsets, bias=up_bias, is_transposed=self.is_transposed)
    if up_name in factors:
        h = h + _low_rank(x.to(h.dtype), factors[up_name], offsets)  # [S, 2I] or [S, I]
    if sentinel is not None:
        h = h.masked_fill(sentinel, 0.0)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)  # [S, I]

    down_bias = self.down_proj_bias[expert_ids_g] if self.has_bias else None
    out = grouped_linear(h, self.down_proj, offsets, bias=down_bias, is_transposed=self.is_transposed)
    if "down_proj" in factors:
        out = out + _low_rank(h.to(out.dtype), factors["down_proj"], offsets)  # [S, H]
    if sentinel is not None:
        out = out.masked_fill(sentinel, 0.0)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=device)
    out = out[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)  # [T, H]
    return out.to(hidden_states.dtype)


ExpertsInterface.register(SPLIT_IMPL, split_lora_experts_forward)


class SplitParamWrapper(ParamWrapper):
    """PEFT's expert-parameter LoRA, applied as activations when the experts compute with
    `SPLIT_IMPL` (see the module docstring); parameters and state dict are PEFT's own."""

    def _split_factors(self, adapter: str):
        """(P [E, in, r], Q [E, r, out], scale) with x·P·Q·scale = x · delta, where `delta` is
        laid out as the experts module uses its weight (x·W when transposed, else x·Wᵀ)."""
        lhs, rhs, scale = self.get_delta_factors(adapter)  # delta = scale · lhs @ rhs
        if self._did_swap_in_out_features:  # weight [E, out, in], delta = B·A: x·Aᵀ·Bᵀ
            lhs, rhs = rhs.transpose(-2, -1), lhs.transpose(-2, -1)
        # else weight [E, in, out], delta = Aᵀ·Bᵀ: x·Aᵀ·Bᵀ as it stands.
        # torch's grouped_mm wants each expert's matrix dense: the factors are views of
        # PEFT's [E·r, in] / [out, E·r] Linear weights; copying them is r/(in+out) of the
        # expert weights' size, the saving this module exists for.
        return lhs.contiguous(), rhs.contiguous(), scale

    @contextmanager
    def _activate_lora(self, active_adapters: list[str]):
        experts = self.get_base_layer()
        adapters = [a for a in (active_adapters or []) if a in self.lora_A]
        impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
        fn = getattr(self, LOW_RANK, None)
        if fn is not None and adapters and (impl != SPLIT_IMPL or len(adapters) != 1):
            # PEFT's path would add a whole-shape delta to this rank's shard of the weight
            raise RuntimeError(f"LoRA on {self.parameter_name} is tensor-parallel: it computes "
                               f"with experts implementation {SPLIT_IMPL!r} and one active "
                               f"adapter only (here {impl!r}, {len(adapters)} adapters)")
        if impl != SPLIT_IMPL or len(adapters) != 1 or self.num_experts <= 1:
            with super()._activate_lora(active_adapters):
                yield
            return
        factors = getattr(experts, _FACTORS, None)
        if factors is None:
            factors = {}
            object.__setattr__(experts, _FACTORS, factors)  # a plain dict, not a submodule
        factors[self.parameter_name] = (*self._split_factors(adapters[0]), fn)
        try:
            yield
        finally:
            factors.pop(self.parameter_name, None)


def enable_split_lora(model: torch.nn.Module) -> int:
    """Make every PEFT expert-parameter LoRA of `model` a `SplitParamWrapper` (in place;
    parameters untouched). Returns how many were converted."""
    count = 0
    for module in model.modules():
        if type(module) is ParamWrapper:
            # A class swap, not a rebuild: PEFT creates the wrapper in its injection code
            # (no hook to choose its class for target_parameters); SplitParamWrapper adds
            # no state, so the module's parameters and PEFT's bookkeeping stay as they are.
            module.__class__ = SplitParamWrapper
            count += 1
    return count


def available() -> bool:
    """True when transformers' experts registry holds the split implementation."""
    return SPLIT_IMPL in ALL_EXPERTS_FUNCTIONS
