"""Per-row LoRA for mixed-adapter batches (Punica/S-LoRA's gather + batched matmul).

Why hand-written: PEFT's mixed-batch path (`adapter_names=`) loops over the
adapters present in every LoRA layer and re-registers hooks on every call,
so a batch spread over 4 adapters costs several times one adapter; PEFT's
`disable_adapter()` for base rows also walks the whole module tree each step.
Here each PEFT `lora.Linear` keeps its own adapters disabled (it returns the
base layer's output) and a forward hook adds the LoRA delta of each row's
adapter with one gather and two `bmm`s, whatever the number of adapters:

    delta[b] = scale[s_b] * (x[b] @ A[s_b]^T) @ B[s_b]^T     s_b = adapter slot of row b

Slot 0 is "no adapter" (zero weights), ranks are zero-padded to the largest.
Only plain LoRA on Linear modules qualifies; expert LoRA (`ParamWrapper`),
DoRA or LoRA on embeddings use PEFT's own per-adapter forwards instead.

Axis legend: B rows, C tokens per row, I in features, O out features, R rank.
"""

from __future__ import annotations

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
    """Stacks of the resident adapters' LoRA weights and the hooks that apply them.

    Args:
        peft_model: the PeftModel whose `lora.Linear` layers are taken over.
        names: adapter names, in slot order (slot i + 1).
    """

    def __init__(self, peft_model, names: list[str]):
        # lazy: peft: heavy, loaded only when this runs
        from peft.tuners.lora.layer import Linear

        self.slot = {name: i + 1 for i, name in enumerate(names)}
        self.rows: torch.Tensor | None = None  # [B] slot per row while a forward runs
        self._handles = []
        for module in peft_model.modules():
            if isinstance(module, Linear):
                stack = self._stack(module, names)
                module.enable_adapters(False)  # PEFT's own LoRA path off: the hook adds it
                self._handles.append(module.register_forward_hook(self._hook(stack)))

    @staticmethod
    def _stack(module, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        base = module.get_base_layer().weight  # [O, I]
        ranks = [module.lora_A[n].weight.shape[0] for n in names if n in module.lora_A]
        rank = max(ranks, default=1)
        a = base.new_zeros(len(names) + 1, rank, base.shape[1])  # [S, R, I]
        b = base.new_zeros(len(names) + 1, base.shape[0], rank)  # [S, O, R]
        scale = base.new_zeros(len(names) + 1)  # [S]
        for i, name in enumerate(names, start=1):
            if name in module.lora_A:
                r = module.lora_A[name].weight.shape[0]
                a[i, :r] = module.lora_A[name].weight
                b[i, :, :r] = module.lora_B[name].weight
                scale[i] = module.scaling[name]
        return a, b, scale

    def _hook(self, stack):
        a, b, scale = stack

        def add_delta(_module, args, output):
            rows = self.rows
            if rows is None:
                return output
            x = args[0]  # [B, C, I]
            if x.dim() != 3 or x.shape[0] != rows.shape[0]:
                # not per-row (a vision tower's [patches, I] during one sequence's prefill):
                # every token belongs to the one adapter of this forward
                if rows.unique().numel() != 1:
                    raise RuntimeError(f"LoRA input of shape {tuple(x.shape)} in a {rows.shape[0]}-row batch")
                s = int(rows[0])
                delta = (x.to(a.dtype) @ a[s].T) @ b[s].T  # [..., O]
                return output + (delta * scale[s]).to(output.dtype)
            h = torch.bmm(x.to(a.dtype), a[rows].transpose(1, 2))  # [B, C, R]
            delta = torch.bmm(h, b[rows].transpose(1, 2))  # [B, C, O]
            return output + (delta * scale[rows][:, None, None]).to(output.dtype)
        return add_delta

    def close(self, peft_model) -> None:
        """Remove the hooks and give the layers back to PEFT."""
        # lazy: peft: heavy, loaded only when this runs
        from peft.tuners.lora.layer import Linear

        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in peft_model.modules():
            if isinstance(module, Linear):
                module.enable_adapters(True)
