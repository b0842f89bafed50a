"""Context parallelism: one sequence split over the ranks of a CP group.

All-to-all head sharding (DeepSpeed-Ulysses), not ring attention. Each CP rank
holds S / CP consecutive tokens of every row through the whole model (the
embedding, norms, MLP / MoE, LoRA, the loss and its activations are per
token, so they need nothing). Only attention mixes tokens: there the query,
key and value heads are exchanged by one all-to-all so each rank holds H / CP
heads over the whole sequence, the model's own attention kernel (SDPA) runs
on them, and a second all-to-all brings the output back to the rank's tokens.
Why this and not ring attention:
  - it keeps the model's attention maths as is: GQA, MLA (queries and keys of
    one width, values of another, softmax scale of the family) and sliding
    windows need no per-family ring kernel, and RoPE is applied by the model on
    each rank's own positions before the exchange;
  - its traffic per layer is 4 all-to-alls of the layer's q/k/v/o activations,
    which on one high-bandwidth domain is cheaper than CP - 1 ring steps of K/V;
  - its limit is CP <= attention heads (KV heads are repeated to the query
    heads when CP does not divide them), far above what one sequence needs.
Hybrid linear-attention layers (a recurrence over the sequence, not softmax
attention) would need their state passed from rank to rank; CP refuses them.

The attention mask is built here for the whole sequence from the row's global
position ids (packed examples restart at 0: causal inside each example, as
transformers' packed-sequence mask), so the model's per-rank mask is not
built at all (a registered mask function that returns None inside a CP step;
outside one, in evaluation and generation, attention and mask are plain SDPA's).

The loss: labels are shifted by one over the WHOLE row before it is split
(the last token of a piece predicts the first of the next), each rank sums its
tokens' losses, and the step divides by the target-token count of all ranks
(moeflow.training.steps.accumulate), so CP=2 gives the single-process loss and
gradients.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moeflow.core.errors import UserError

if TYPE_CHECKING:  # types only
    from transformers import PreTrainedModel

NAME = "moeflow_context_parallel"
_STATE: dict = {}


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all on dim 0; its gradient is the same exchange of the gradient
    (piece j went to rank j, so its gradient comes back from rank j)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _exchange(x: torch.Tensor, group, cp: int, split_dim: int, cat_dim: int) -> torch.Tensor:
    """all-to-all: cut `x` into CP pieces on `split_dim`, send piece j to rank j, and join
    the pieces received on `cat_dim` in rank order."""
    pieces = torch.stack(x.chunk(cp, dim=split_dim)).contiguous()  # [CP, ...]
    return torch.cat(_AllToAll.apply(pieces, group).unbind(0), dim=cat_dim)


def whole_sequence_mask(positions: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """Boolean [B, 1, S, S] (True: attend) of packed rows: causal inside each example
    (positions restart at 0 where an example starts), optionally a sliding window.
    None when every row is one example and there is no window (plain causal)."""
    B, S = positions.shape
    idx = torch.arange(S, device=positions.device)
    if window is None and bool((positions == idx).all()):
        return None
    seg = torch.cumsum(positions == 0, dim=1)  # [B, S] example index
    mask = (seg[:, :, None] == seg[:, None, :]) & (idx[None, :, None] >= idx[None, None, :])
    if window is not None:
        mask &= idx[None, :, None] - idx[None, None, :] < window
    return mask[:, None]  # [B, 1, S, S]


def ulysses_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers attention function (`AttentionInterface`): q [B, Hq, s, D],
    k [B, Hkv, s, D], v [B, Hkv, s, Dv] of this rank's s = S / CP tokens.

    Returns:
        (attention output [B, s, Hq, Dv], None) as transformers' SDPA does.
    """
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    st = _STATE
    if not st:  # evaluation, generation: the whole sequence is on this rank
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    cp, group = st["cp"], st["group"]
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % cp:
        raise UserError(f"context_parallel={cp} does not divide {heads} attention heads")
    groups = heads // kv_heads
    if kv_heads % cp:  # too few KV heads to split: give every query head its own
        key, value, groups = repeat_kv(key, groups), repeat_kv(value, groups), 1
    q, k, v = (_exchange(t, group, cp, 1, 2) for t in (query, key, value))  # [B, H/CP, S, D]
    window = sliding_window or getattr(module, "sliding_window", None)
    mask = st["mask"].get(window, "unset")
    if mask == "unset":
        mask = st["mask"][window] = whole_sequence_mask(st["positions"], window)
    out, _ = sdpa_attention_forward(_heads(groups, module.training), q, k, v, mask, dropout=dropout, scaling=scaling,
                                    is_causal=mask is None)  # [B, S, H/CP, Dv]
    return _exchange(out, group, cp, 1, 2), None  # [B, s, H, Dv]


class _Heads(nn.Module):
    """What transformers' SDPA function reads of the attention module it is handed, for the
    exchanged heads: query heads per KV head (1 once the KV heads were repeated), causal.
    A module of no parameters: the function takes a Module."""

    def __init__(self, groups: int, training: bool):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = training


@functools.cache
def _heads(groups: int, training: bool) -> _Heads:
    """One `_Heads` per (groups, training), reused: a Module takes tens of us to construct, and
    this runs in every attention layer's forward (and again under recompute)."""
    return _Heads(groups, training)


def _mask(*args, **kwargs):
    """Inside a CP step none (the whole-sequence mask is built in the attention function);
    outside it, transformers' own SDPA mask."""
    if _STATE:
        return None
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def install(model: PreTrainedModel) -> None:
    """Switch `model`'s attention to the context-parallel function (registered once).

    Raises:
        UserError: the model has token mixers that are not softmax attention.
    """
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ())
    other = kinds - {"full_attention", "sliding_attention", "chunked_attention"}
    if other:
        raise UserError(f"context parallelism: {model.config.model_type} has "
                        f"{', '.join(sorted(other))} layers, whose recurrence over the sequence "
                        "CP does not split; plan context_parallel: 1")
    AttentionInterface.register(NAME, ulysses_attention)
    AttentionMaskInterface.register(NAME, _mask)
    model.set_attn_implementation(NAME)


def split(batch: dict, cp: int, cp_rank: int) -> dict:
    """This rank's piece of a micro-batch, labels shifted over the whole row first.

    Args:
        batch: {"input_ids", "labels", "position_ids", "real"} each [B, S].

    Returns:
        The same keys, each [B, S / CP], plus "shifted": True (labels are the next token's)
        and "positions": the whole rows' position ids [B, S] (for the mask).
    """
    S = batch["input_ids"].shape[1]
    if S % cp:
        raise UserError(f"data.seq_len {S} is not a multiple of context_parallel={cp}")
    labels = torch.full_like(batch["labels"], -100)
    labels[:, :-1] = batch["labels"][:, 1:]  # [B, S]: the target of each position
    s = S // cp
    sl = slice(cp_rank * s, (cp_rank + 1) * s)
    out = {k: v[:, sl] for k, v in batch.items() if k != "labels"}
    out.update(labels=labels[:, sl], shifted=True, positions=batch["position_ids"])
    return out


@contextlib.contextmanager
def context_parallel(positions: torch.Tensor, group, cp: int):
    """The forward(s) inside see one sequence split over the CP group.

    Args:
        positions: position ids [B, S] of the whole rows this step's forward runs on.
    """
    _STATE.update(positions=positions, group=group, cp=cp, mask={})
    try:
        yield
    finally:
        _STATE.clear()
