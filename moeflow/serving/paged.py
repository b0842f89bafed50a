"""Paged KV cache and attention over it: rows packed into one forward, no padding between them.

The engine's KV cache for models whose every layer is plain full attention:
per layer one keys and one values tensor of `num_blocks * block_size` token
slots ([S, H, D]), handed out in blocks by `BlockPool` (block_pool.py). A step
packs every scheduled row's new tokens into one `[1, T]` forward -- decode
tokens and prompt chunks side by side, vLLM's varlen batch -- and:

- `PagedCache.update` (called by each attention layer with its new keys and
  values) writes them into their slots;
- `paged_attention` (registered with transformers' `AttentionInterface` and
  selected for the packed forward only) gathers each row's keys and values
  from the pool through its block table: the decoding rows in one SDPA call
  as `[B, H, L, D]` (the query heads of one kv head packed as query rows,
  each row masked to its own length), each prompt chunk in one SDPA call of
  its own with a causal mask offset by what it had cached.

A row joining or leaving copies no other row's keys and values; a finished
row's blocks go back to the pool. The mask transformers would build is not
needed (the function is not in `AttentionMaskInterface`, so the model skips
mask creation: its documented path for custom attention).

Why our own packed attention rather than transformers' paged cache: its
`PagedAttentionCache` comes with its continuous-batching scheduler's request
state, sizes itself from free device memory and (under SDPA) attends over one
`[T, N]` mask of the whole batch, whose cost grows with rows x all rows'
tokens; the model code already calls `cache.update(..., kwargs=...)` and the
attention interface with the forward's kwargs, so a cache object and an
attention function are all a paged forward needs. Which models can take it is
read from the cache the model builds (`pageable`); the others keep the padded
batches of kv_cache.py.

Axis legend: T packed new tokens, S slots, H kv heads, Q query heads, D head dim, B rows, L keys.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, cast

import torch
import torch.nn.functional as F

log = logging.getLogger("moeflow.serving")

ATTENTION = "moeflow_paged"


def pageable(model: Any) -> str | None:
    """None when the model's KV cache can be paged here; else why not (one line for the log).

    Read from what transformers builds for the model: a `DynamicCache` of plain `DynamicLayer`s
    only (no sliding window, no linear-attention state), SDPA or eager attention, and no
    attention extra that the packed attention does not apply (sinks, logit soft-capping,
    chunked attention, M-RoPE of multimodal models)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    text = model.config.get_text_config()
    if text is not model.config:
        return "a multimodal model (its positions are not a row's token count)"
    try:
        cache = DynamicCache(config=text)
    except Exception as exc:  # a model with a cache of its own
        return f"its cache cannot be built from the config ({exc})"
    if not cache.layers or not all(type(layer) is DynamicLayer for layer in cache.layers):
        return "not every layer is plain full attention (sliding windows or linear-attention states)"
    if getattr(text, "_attn_implementation", None) not in ("sdpa", "eager"):
        return f"its attention is {text._attn_implementation!r}"
    if getattr(text, "attention_chunk_size", None) or getattr(text, "attn_logit_softcapping", None):
        return "chunked attention or logit soft-capping"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks"
    return None


@dataclass
class Row:
    """One row of a packed forward: its new tokens sit at [start, start + n) of the pack and
    at positions [cached, cached + n) of its sequence, whose blocks are `blocks`."""

    start: int
    n: int
    cached: int
    blocks: list[int]


class StepLayout:
    """Where a packed forward's tokens go and what each row attends to (built once per forward,
    used by every layer).

    Args:
        rows: the forward's rows in pack order.
        block_size: token slots per block.
        pad: a slot of zeros that masked columns read (an unwritten slot may hold NaN, and a
            masked NaN value still poisons SDPA's weighted sum: 0 x NaN).
        device: the model's device.
    """

    def __init__(self, rows: list[Row], block_size: int, pad: int, device: torch.device):
        bs = block_size
        write: list[int] = []
        for r in rows:
            write += [r.blocks[p // bs] * bs + p % bs for p in range(r.cached, r.cached + r.n)]
        self.write = torch.tensor(write, device=device)  # [T]
        dec = [r for r in rows if r.n == 1]
        self.prefills = [r for r in rows if r.n > 1]
        self.dec_pos = None
        if dec:
            width = max(len(r.blocks) for r in dec)
            tables = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in dec])  # [B, blocks]
            lengths = torch.tensor([r.cached + 1 for r in dec])  # [B]
            keys = int(lengths.max())
            # [B, L]: each row's slots in order; columns past a row's length read the zero slot, masked
            read = (tables[:, :, None] * bs + torch.arange(bs)).reshape(len(dec), -1)[:, :keys]
            mask = torch.arange(keys)[None, :] < lengths[:, None]  # [B, L]
            self.dec_read = torch.where(mask, read, pad).to(device)
            self.dec_mask = mask.to(device)[:, None, None, :]  # [B, 1, 1, L]
            self.dec_pos = torch.tensor([r.start for r in dec], device=device)  # [B]
            self.dec_all = len(dec) == len(rows)
        self.pre_read = [(torch.tensor(r.blocks)[:, None] * bs + torch.arange(bs)).flatten()[:r.cached + r.n].to(device)
                         for r in self.prefills]  # per prompt row [L]
        self.pre_mask = [None if r.cached == 0 else  # [1, 1, C, L]: causal, offset by what was cached
                         (torch.arange(r.cached + r.n)[None, :] <= torch.arange(r.cached, r.cached + r.n)[:, None]
                          ).to(device)[None, None] for r in self.prefills]


class PagedCache:
    """The keys and values of every layer in slots ([S, H, D] each), what a packed forward
    passes as `cache`. Only the two calls the model code makes are implemented: `update`
    (write this forward's keys and values) and the length question of a model that computes
    positions itself (the engine always passes positions).

    A layer's tensors are made at its first write, shaped as the keys and values its attention
    produces (heads and head dims read from them, not from the config: multi-head latent
    attention's keys and values differ in both).

    Args:
        num_layers: the model's layers.
        num_slots: token slots (blocks x block size).
    """

    is_compileable = False

    def __init__(self, num_layers: int, num_slots: int):
        # one more slot (`pad`) holds zeros for the masked columns of the decode rows' reads
        self.pad = num_slots
        self.keys: list[torch.Tensor] = [torch.empty(0)] * num_layers  # [S + 1, H, D] each, once written
        self.values: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.layout: StepLayout | None = None

    def _make(self, like: torch.Tensor) -> torch.Tensor:
        """A layer's slots for tensors like `like` ([1, H, T, D]); empty: pages the OS never
        touched cost no memory until a block is used."""
        t = like.new_empty(self.pad + 1, like.shape[1], like.shape[3])
        t[self.pad].zero_()
        return t

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's keys and values ([1, H, T, D]) into their slots; they are
        returned unchanged (`paged_attention` reads the pool)."""
        assert self.layout is not None, "a paged forward runs inside PagedCache.step"
        if not self.keys[layer_idx].numel():
            self.keys[layer_idx], self.values[layer_idx] = self._make(key), self._make(value)
        self.keys[layer_idx].index_copy_(0, self.layout.write, key[0].transpose(0, 1).to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(0, self.layout.write,
                                           value[0].transpose(0, 1).to(self.values[layer_idx].dtype))
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @contextlib.contextmanager
    def step(self, model: Any, layout: StepLayout) -> Iterator[None]:
        """Run a packed forward of `layout` over this cache: the model's attention is
        `paged_attention` inside, what it was after."""
        text = model.config.get_text_config()
        before = text._attn_implementation
        self.layout = layout
        text._attn_implementation = ATTENTION
        try:
            yield
        finally:
            text._attn_implementation = before
            self.layout = None


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of a packed forward (query [1, Q, T, D]) over each row's slots; returns [1, T, Q, D]."""
    cache: PagedCache = kwargs["moeflow_cache"]
    layout = cache.layout
    assert layout is not None
    layer = cast(int, module.layer_idx)  # transformers' attention modules know their layer
    kp, vp = cache.keys[layer], cache.values[layer]  # [S, H, D]
    heads_q, d = query.shape[1], query.shape[3]
    heads_kv, dv = kp.shape[1], vp.shape[2]  # the values' head dim may differ (latent attention)
    group = heads_q // heads_kv
    q = query[0]  # [Q, T, D]
    out = query.new_empty(q.shape[1], heads_q, dv)  # [T, Q, Dv]
    if layout.dec_pos is not None:
        b = layout.dec_pos.shape[0]
        qd = q if layout.dec_all else q[:, layout.dec_pos]  # [Q, B, D]
        qd = qd.transpose(0, 1).reshape(b, heads_kv, group, d)  # one kv head's query heads as query rows
        k = kp[layout.dec_read].transpose(1, 2)  # [B, H, L, D]
        v = vp[layout.dec_read].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, k.to(qd.dtype), v.to(qd.dtype), attn_mask=layout.dec_mask,
                                           scale=scaling)  # [B, H, group, D]
        o = o.reshape(b, heads_q, dv)
        if layout.dec_all:
            out = o
        else:
            out[layout.dec_pos] = o
    for row, read, mask in zip(layout.prefills, layout.pre_read, layout.pre_mask):
        # 4-D [1, heads, tokens, D] with the kv heads as they are (enable_gqa): torch's CPU flash
        # kernel takes that shape with or without a mask; a 3-D call falls back to the math path,
        # which materialises every [Q, C, L] score and measured 15-25x slower at a 4,096 context
        qp = q[None, :, row.start:row.start + row.n]  # [1, Q, C, D]
        k = kp[read].transpose(0, 1)[None]  # [1, H, L, D]
        v = vp[read].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qp, k.to(qp.dtype), v.to(qp.dtype), attn_mask=mask,
                                           is_causal=mask is None, scale=scaling, enable_gqa=group > 1)
        out[row.start:row.start + row.n] = o[0].transpose(0, 1)  # [C, Q, Dv]
    return out.unsqueeze(0), None


def register() -> None:
    """Make `paged_attention` selectable by name (transformers' AttentionInterface)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)
