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

from typing import Any

import torch


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
    """Stacks of the resident adapters' LoRA weights and the forwards that apply them.

    Args:
        peft_model: the PeftModel whose `lora.Linear` layers are taken over.
        names: adapter names, in slot order (slot i + 1).
    """

    def __init__(self, peft_model, names: list[str]):
        # lazy: peft: heavy, loaded only when this runs
        from peft.tuners.lora.layer import Linear

        self.slot = {name: i + 1 for i, name in enumerate(names)}
        self._rows: torch.Tensor | None = None  # [B] slot per row while a forward runs
        self._uniform: int | None = None  # the one slot of every row, if they share one
        self._taken: list = []
        groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        where: list[tuple[Any, tuple, int]] = []  # (a PEFT lora.Linear, its group, its index there)
        for module in peft_model.modules():
            if isinstance(module, Linear):
                a, b = self._stack(module, names)
                key = (tuple(a.shape), tuple(b.shape), a.dtype, a.device)
                group = groups.setdefault(key, [])
                where.append((module, key, len(group)))
                group.append((a, b))
        # per shape group: [M, S, I, R] and [M, S, R, O]; a forward gathers its rows' slots once
        self._stacks = {key: (torch.stack([a for a, _ in g]), torch.stack([b for _, b in g]))
                        for key, g in groups.items()}
        self._gathered: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, key, j in where:
            module.enable_adapters(False)  # PEFT's own LoRA path off (as a fallback it adds nothing)
            module.forward = self._forward(module, key, j)
            self._taken.append(module)

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
    def _stack(module, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """A' [S, I, R] and B' [S, R, O] (transposed, the scale folded into B')."""
        base = module.get_base_layer().weight  # [O, I]
        ranks = [module.lora_A[n].weight.shape[0] for n in names if n in module.lora_A]
        rank = max(ranks, default=1)
        a = base.new_zeros(len(names) + 1, base.shape[1], rank)  # [S, I, R]
        b = base.new_zeros(len(names) + 1, rank, base.shape[0])  # [S, R, O]
        for i, name in enumerate(names, start=1):
            if name in module.lora_A:
                r = module.lora_A[name].weight.shape[0]
                a[i, :, :r] = module.lora_A[name].weight.T
                b[i, :r] = module.lora_B[name].weight.T * module.scaling[name]
        return a, b

    def _forward(self, module, key: tuple, j: int):
        base_layer = module.get_base_layer()
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

    def close(self, peft_model) -> None:
        """Give the layers back to PEFT (their own forward, their adapters enabled)."""
        for module in self._taken:
            del module.forward  # the instance attribute: the class's forward again
            module.enable_adapters(True)
        self._taken = []
        self._stacks, self._gathered = {}, {}
