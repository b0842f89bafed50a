"""Per-row and per-token LoRA for mixed-adapter batches (Punica/S-LoRA's idea, on CPU).

Why hand-written: PEFT's mixed-batch path (`adapter_names=`) loops over the
adapters present in every LoRA layer and re-registers hooks on every call,
so a batch spread over 4 adapters costs several times one adapter; PEFT's
`disable_adapter()` for base rows also walks the whole module tree each step.
Here each PEFT `lora.Linear`'s forward is replaced (on the instance) by one
that runs its base layer and adds the LoRA delta of each token's adapter:

    delta[t] = (x[t] @ A'[s_t]) @ B'[s_t]     s_t = adapter slot of token t
    A' = A^T [S, I, R],  B' = scale * B^T [S, R, O]   (transposed, scale folded in, once)

Slot 0 is "no adapter" (zero weights), ranks are zero-padded to the largest.
Before a forward, `select` says each row's slot and, for a packed forward (rows
concatenated along tokens, a [1, T, I] input: paged.py), each row's token
count, from which the token -> slot map is built; a padded batch's [B, C, I]
input takes its row's slot for every column.

How the delta is computed, picked per forward (`_plan`) by what is cheapest on CPU,
where a step of a small model is mostly per-op dispatch:

- all tokens one slot: x @ A'[s] @ B'[s], no gather (slot 0: nothing);
- "dense", the default: the slots present in the forward side by side,
  A'_p [I, k*R] and B'_p [k*R, O] (gathered per shape group when the set of slots
  present changes, kept while it holds), and a 0/1 mask [N, k*R] keeping each
  token's own slot's R columns (built per map, kept while the map holds): three ops
  per module (matmul, mask, matmul-add) whatever the mix, at k times the LoRA
  FLOPs of one adapter;
- "runs", where those k-fold FLOPs outweigh dispatch (many tokens, wide
  modules, many slots: `_DENSE_FLOPS`): S-LoRA/Punica's SGMV, two matmuls per
  run of consecutive tokens of one slot, on slices (no gather); the runner
  packs rows ordered by slot so a packed forward has one run per adapter.

Measured per LoRA module on the 2-core CPU host (one thread, 16 rows of rank-8 adapters,
host load 20-67 so +-30%): the demo model's 64-wide layers, 16 slots, 16 decode tokens:
dense 0.26 ms, runs 1.4 ms (the base layer 0.06 ms); 256 tokens: dense 1.1 ms, runs 2.0 ms.
1024-wide layers, rank 16, 256 tokens of 16 slots: dense 78 ms, runs 47 ms (base 44 ms).
Gathering each token's A' and B' for a batched matmul (Punica's BGMV; what the padded
path did per row) cost 4.5 ms at 256 tokens on the demo shapes in a first, rougher
measurement (dense 0.8 ms there): it copies I x R weights per token.
Only plain LoRA on Linear modules qualifies; expert LoRA (`ParamWrapper`),
DoRA or LoRA on embeddings use PEFT's own per-adapter forwards instead.

Axis legend: B rows, C tokens per row, T packed tokens, N tokens of a module's input
(B x C or T), I in features, O out features, R rank, S slots (adapters + 1), k slots present,
M modules of one shape group.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch

Weights = tuple[torch.Tensor, torch.Tensor, float]  # LoRA A [R, I], B [O, R], scale

# "dense" while its extra multiply-adds, N x (I + O) x R x (k - 1), stay under this many
# per slot (each run of "runs": two matmuls and an add, tens of us of dispatch on CPU); past
# it, "runs". Set from the measurements in the module docstring (demo shapes, 256 tokens,
# k = 16: 4M extra per module, dense faster; 1024-wide, 256 tokens, k = 16: 126M, runs faster;
# 1024-wide, 16 tokens, k = 16: 8M, dense slightly faster)
_DENSE_FLOPS = 1 << 20


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
        self._rows: list[int] | None = None  # [B] slot per row while a forward runs
        self._uniform: int | None = None  # the one slot of every token, if they share one
        self._maps: dict[str, list[int]] = {}  # "token" [T], "keep" [K]: a packed forward's slot maps
        self._present: list[int] | None = None  # [k] the slots of the last mixed forward, ascending
        self._plans: dict[tuple, Any] = {}  # (shape group, input shape) -> how its delta is computed
        self._masks: dict[tuple, tuple[list[int], torch.Tensor]] = {}  # (map, rank, dtype) -> (its slots, mask)
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
        # per shape group: [M, S, I, R] and [M, S, R, O]
        self._stacks = {key: (torch.stack([a for a, _ in g]), torch.stack([b for _, b in g]))
                        for key, g in groups.items()}
        self._side: dict[tuple, tuple[list, list]] = {}  # per group: A'_p, B'_p per module ("dense"), for _present
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
    def rows(self) -> list[int] | None:
        """The slot of each row of the forward running now (None between forwards)."""
        return self._rows

    def select(self, rows: list[int], counts: list[int] | None = None,
               keep: torch.Tensor | int | None = None) -> None:
        """Before a forward: `rows` the slot of each row. A packed forward (its rows' tokens
        side by side, a [1, T] input) also gives `counts`, each row's tokens, and `keep`, the
        transformers `logits_to_keep` (positions, or a count of last positions) that the
        modules after it (an adapted lm_head) see. `clear` after the forward.

        The maps are built as Python lists (a step's rows are a Python list already; a few
        tensor ops per forward cost more than a list of T ints on CPU)."""
        self.clear()
        self._rows = rows
        present = sorted(set(rows))
        if len(present) == 1:
            self._uniform = present[0]
            return
        if present != self._present:  # the slots side by side ("dense") are kept while the set holds
            self._present, self._side, self._masks = present, {}, {}
        if counts is not None:
            token = [s for s, n in zip(rows, counts) for _ in range(n)]  # [T]
            kept = [token[i] for i in keep.tolist()] if isinstance(keep, torch.Tensor) else \
                token[-keep:] if keep else token  # [K]
            self._maps = {"token": token, "keep": kept}

    def clear(self) -> None:
        """After a forward: no slots, no plans."""
        self._rows, self._uniform = None, None
        self._maps, self._plans = {}, {}

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

    def _token_slots(self, shape: torch.Size) -> tuple[str, list[int], int]:
        """The slot map of a module input of `shape` ([..., I]): (its name, its slots, tokens per
        slot entry) -- a packed forward's tokens [1, T] (or the kept ones), or a padded batch's
        rows [B, C] (each row's slot for its C columns)."""
        rows = self._rows
        assert rows is not None
        lead = tuple(shape[:-1])
        if len(lead) == 2 and self._maps and lead[0] == 1:
            for name in ("token", "keep"):
                if len(self._maps[name]) == lead[1]:
                    return name, self._maps[name], 1
        elif len(lead) == 2 and lead[0] == len(rows) and not self._maps:
            return "rows", rows, lead[1]
        # not per row or token (a vision tower's [patches, I] during one sequence's prefill) with
        # tokens of several adapters: no map to apply them by
        raise RuntimeError(f"LoRA input of shape {tuple(shape)} in a forward of {len(rows)} rows "
                           f"of several adapters")

    def _plan(self, key: tuple, shape: torch.Size) -> tuple:
        """How the delta of an input of `shape` is computed in this forward, for every module of
        shape group `key`: ("dense", A'_p [M, I, kR], B'_p [M, kR, O], mask [1, T, kR] or
        [B, 1, kR]) or ("runs", [(slot, start, end)] over the flattened tokens)."""
        present = self._present
        assert present is not None
        name, slots, per = self._token_slots(shape)
        stack_a, stack_b = self._stacks[key]
        m, _, width, rank = stack_a.shape
        k = len(present)
        if len(slots) * per * (width + stack_b.shape[3]) * rank * (k - 1) <= _DENSE_FLOPS * k:
            if key not in self._side:  # per module A'_p [I, kR], B'_p [kR, O] (a list: no indexing op per call)
                index = torch.tensor(present, device=stack_a.device)
                side_a = stack_a.index_select(1, index).permute(0, 2, 1, 3).reshape(m, width, k * rank)
                self._side[key] = (list(side_a), list(stack_b.index_select(1, index).reshape(m, k * rank, -1)))
            a_p, b_p = self._side[key]
            # a decode step's rows are those of the step before: its mask is reused while the map holds
            held = self._masks.get((name, rank, stack_a.dtype))
            if held is None or held[0] != slots:
                where = {s: i for i, s in enumerate(present)}
                which = torch.tensor([where[s] for s in slots], device=stack_a.device)  # index into present
                cols = torch.arange(k * rank, device=stack_a.device) // rank  # [kR]: the present slot of a column
                mask = (which[:, None] == cols).to(stack_a.dtype)  # [N, kR]: 1 at each token's own slot's columns
                held = (slots, mask[None] if name != "rows" else mask[:, None])  # [1, T, kR] or [B, 1, kR]
                self._masks[(name, rank, stack_a.dtype)] = held
            return ("dense", a_p, b_p, held[1])
        runs, start = [], 0
        for slot, group in itertools.groupby(slots):
            n = len(list(group)) * per
            if slot:
                runs.append((slot, start, start + n))
            start += n
        return ("runs", runs)

    def _forward(self, base_layer, key: tuple, j: int):
        stack_a, stack_b = self._stacks[key]
        a_all, b_all = stack_a[j], stack_b[j]  # [S, I, R], [S, R, O]

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            out = base_layer(x, *args, **kwargs)
            if self._rows is None:
                return out
            s = self._uniform
            if s is not None:  # every token one adapter (or none): no gather
                if s == 0:
                    return out
                delta = (x.to(a_all.dtype) @ a_all[s]) @ b_all[s]  # [..., O]
                return out + delta.to(out.dtype)
            plan = self._plans.get((key, x.shape))
            if plan is None:
                plan = self._plans[(key, x.shape)] = self._plan(key, x.shape)
            if plan[0] == "dense":
                _, a_p, b_p, mask = plan
                h = (x if x.dtype == a_all.dtype else x.to(a_all.dtype)) @ a_p[j]  # [.., kR]
                h.mul_(mask)  # each token its own slot's R columns
                if out.dtype == a_all.dtype:  # out + h @ B'_p in one op
                    return torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]),
                                       b_p[j]).view(out.shape)
                return out + (h @ b_p[j]).to(out.dtype)  # [.., O]
            xs, out = x.reshape(-1, x.shape[-1]), out.clone()  # a copy: the base layer's output may be a view
            flat = out.view(-1, out.shape[-1])  # [N, O]
            for slot, a, b in plan[1]:
                flat[a:b] += ((xs[a:b].to(a_all.dtype) @ a_all[slot]) @ b_all[slot]).to(out.dtype)
            return out
        return forward

    def close(self) -> None:
        """Give the layers back (their class's forward; PEFT's layers their adapters enabled)."""
        for module in self._taken:
            del module.forward  # the instance attribute: the class's forward again
            if self._peft:
                module.enable_adapters(True)
        self._taken = []
        self._stacks, self._side, self._masks, self._present = {}, {}, {}, None
        self.clear()


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
