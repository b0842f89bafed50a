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
    at positions [cached, cached + n) of its sequence, whose blocks are `blocks`; `key` names
    the sequence (the decode view keeps a row's keys while the same sequence decodes)."""

    start: int
    n: int
    cached: int
    blocks: list[int]
    key: int = 0


class DecodeView:
    """The decoding rows' keys and values side by side, one [B, H, L, D] tensor per layer,
    kept across steps while the same sequences decode in the same order.

    A decode step's attention needs each row's keys as one batch. Gathering them from the
    pool through the block tables copies every row's whole context in every layer at every
    step (two gathers, a mask and its index built per step: on a small model about as much
    as the SDPA call itself). Here a steady decode step only writes each row's new key and
    value into its column (`append`), and the mask gains one column per row; the view is
    filled from the pool (one gather per layer) only when the decoding rows change (a row
    joins, leaves or is re-prefilled) or outgrow its columns. The pool stays the cache of
    record (prefix caching, preemption, prompt chunks read it); the view is a copy of the
    decoding rows' part of it, so it is bounded: `budget` bytes over all layers, beyond which
    the step gathers from the pool as before (a long context or many rows on a big model).

    Args:
        budget: the most bytes the view may hold over all layers (0: never used).
    """

    PAD = 64  # columns allocated beyond the longest row, so a view lasts that many steps

    def __init__(self, budget: int):
        self.budget = budget
        self.ids: tuple[int, ...] = ()
        self.lengths: list[int] = []  # tokens each row holds in the view
        self.cap = 0  # columns
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.bias: dict[torch.dtype, torch.Tensor] = {}  # [B, 1, 1, cap]: 0 up to a row's length, -inf after
        self.rows = torch.arange(0)  # [B]

    def plan(self, dec: list[Row], slot_bytes: int, num_layers: int,
             device: torch.device) -> tuple[str | None, torch.Tensor | None]:
        """This step's use of the view for decode rows `dec`: ("append", columns [B]) when the
        same rows decode on, ("fill", None) when it is laid anew, (None, None) when it does not
        fit its budget (or the pool's layers are not made yet: `slot_bytes` 0)."""
        ids = tuple(r.key for r in dec)
        cached = [r.cached for r in dec]
        need = max(cached) + 1
        if ids == self.ids and cached == self.lengths and need <= self.cap:
            cols = torch.tensor(cached, device=device)
            for t in self.bias.values():
                t[self.rows, 0, 0, cols] = 0
            self.lengths = [c + 1 for c in cached]
            return "append", cols
        cap = -(-(need + self.PAD) // self.PAD) * self.PAD
        if not slot_bytes or len(dec) * cap * slot_bytes > self.budget:
            self.drop()
            return None, None
        self.ids, self.lengths, self.cap = ids, [c + 1 for c in cached], cap
        self.rows = torch.arange(len(dec), device=device)  # [B]: 0..B-1, the rows' index in the view
        self.k, self.v = [None] * num_layers, [None] * num_layers
        self.bias = {}
        return "fill", None

    def mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The rows' additive mask [B, 1, 1, cap] of `dtype` (0 or -inf)."""
        if dtype not in self.bias:
            lengths = torch.tensor(self.lengths)
            with torch.inference_mode(False):  # `plan` opens its columns between steps: a normal tensor
                self.bias[dtype] = torch.where(torch.arange(self.cap)[None, :] < lengths[:, None], 0.0,
                                               float("-inf")).to(device=device, dtype=dtype)[:, None, None, :]
        return self.bias[dtype]

    def drop(self) -> None:
        """Forget the view (its memory goes back; the next decode step lays it anew)."""
        self.ids, self.lengths, self.cap, self.k, self.v, self.bias = (), [], 0, [], [], {}


class StepLayout:
    """Where a packed forward's tokens go and what each row attends to (built once per forward,
    used by every layer).

    Built from a few batched ops, not per row: on a small model a step's Python and tensor
    calls cost as much as its math (a 16-row decode step of the demo model is about 3 ms).

    Args:
        rows: the forward's rows in pack order.
        block_size: token slots per block.
        pad: a slot of zeros that masked columns read (an unwritten slot may hold NaN, and a
            masked NaN value still poisons SDPA's weighted sum: 0 x NaN).
        device: the model's device.
        memo: what the last step's layout kept for the next (`_slots`; the cache's `memo`).
        view: the cache's decode view (DecodeView), None: gather every step.
        view_slot_bytes: one token slot's bytes over all layers (keys and values); 0: unknown yet.
        view_layers: the model's layers.
    """

    def __init__(self, rows: list[Row], block_size: int, pad: int, device: torch.device,
                 memo: dict[str, Any] | None = None, view: DecodeView | None = None,
                 view_slot_bytes: int = 0, view_layers: int = 0):
        bs = block_size
        write: list[int] = []
        for r in rows:
            if r.n == 1:
                write.append(r.blocks[r.cached // bs] * bs + r.cached % bs)
            else:
                write += [r.blocks[p // bs] * bs + p % bs for p in range(r.cached, r.cached + r.n)]
        self.write = torch.tensor(write, device=device)  # [T]
        dec = [r for r in rows if r.n == 1]
        self.dec_pos: torch.Tensor | None = None
        self.dec_span: tuple[int, int] | None = None  # the decode rows' [start, end) of the pack, when adjacent
        self._bias: dict[torch.dtype, torch.Tensor] = {}
        self.dec_all, self.dec_keys = False, 0
        # the decode view (DecodeView): used where the decode rows sit side by side in the pack
        self.view: DecodeView | None = None
        self.view_mode: str | None = None
        self.view_cols: torch.Tensor | None = None  # "append": each row's new column [B]
        self.view_rows: torch.Tensor | None = None  # [B]: 0..B-1
        if dec:
            starts = [r.start for r in dec]
            if starts == list(range(starts[0], starts[0] + len(dec))):
                self.dec_span = (starts[0], starts[0] + len(dec))
            else:
                self.dec_pos = torch.tensor(starts, device=device)  # [B]
            self.dec_all = len(dec) == len(rows)
            self.dec_keys = keys = max(r.cached for r in dec) + 1
            if view is not None and self.dec_span is not None:
                self.view_mode, self.view_cols = view.plan(dec, view_slot_bytes, view_layers, device)
                if self.view_mode is not None:
                    self.view = view
                    self.view_rows = view.rows
            elif view is not None:
                view.drop()
            if self.view_mode != "append":  # the gather from the pool: this step's attention, or the view's fill
                slots, columns = self._slots([r.blocks for r in dec], bs, memo if memo is not None else {})
                lengths = torch.tensor([r.cached + 1 for r in dec])  # [B]
                # [B, L]: each row's slots in order; columns past a row's length read the zero slot, masked
                self.dec_mask = columns[:keys][None, :] < lengths[:, None]  # [B, L]
                self.dec_read = torch.where(self.dec_mask, slots[:, :keys], pad).view(-1).to(device)  # [B * L]
                self.dec_mask = self.dec_mask.to(device)
        self.dec_rows = len(dec)
        prefills = [r for r in rows if r.n > 1]
        # prompt rows with nothing cached attend to their own new keys only: runs of adjacent ones
        # of one length go to SDPA as one batch (causal), their keys taken from the forward itself;
        # a chunk after cached tokens reads its context from the pool (mask offset by what it had)
        self.fresh: list[tuple[int, int, int]] = []  # (start, rows, tokens each)
        self.chunks: list[tuple[Row, torch.Tensor, torch.Tensor]] = []  # (row, read [L], mask [1, 1, C, L])
        for r in prefills:
            if r.cached == 0:
                last = self.fresh[-1] if self.fresh else None
                if last is not None and last[2] == r.n and last[0] + last[1] * last[2] == r.start:
                    self.fresh[-1] = (last[0], last[1] + 1, r.n)
                else:
                    self.fresh.append((r.start, 1, r.n))
                continue
            read = (torch.tensor(r.blocks)[:, None] * bs + torch.arange(bs)).flatten()[:r.cached + r.n]
            mask = torch.arange(r.cached + r.n)[None, :] <= torch.arange(r.cached, r.cached + r.n)[:, None]
            self.chunks.append((r, read.to(device), mask.to(device)[None, None]))

    @staticmethod
    def _slots(tables: list[list[int]], bs: int, memo: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' slots in token order [B, blocks * bs] (tables padded with block 0) and
        the column numbers [blocks * bs]; kept in `memo` (the cache's, across steps) while the rows
        and their tables stay the same, as they do between most decode steps (a row takes a new
        block every `bs` tokens)."""
        if memo.get("tables") != tables or memo.get("bs") != bs:
            width = max(len(t) for t in tables)
            padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [B, blocks]
            columns = torch.arange(width * bs)
            memo.update(tables=[list(t) for t in tables], bs=bs, columns=columns,
                        slots=(padded[:, :, None] * bs + columns[:bs]).view(len(tables), -1))
        return memo["slots"], memo["columns"]

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The decode rows' mask as SDPA's additive mask [B, 1, 1, L] (0 or -inf) of `dtype`, made
        once per step: a boolean mask is turned into this inside every SDPA call (measured 52 against
        36 us a call for 16 rows)."""
        if dtype not in self._bias:
            self._bias[dtype] = torch.where(self.dec_mask, 0.0, float("-inf")).to(dtype)[:, None, None, :]
        return self._bias[dtype]


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
        view_bytes: the decode view's budget (DecodeView); 0: no view, every decode step gathers.
    """

    is_compileable = False

    def __init__(self, num_layers: int, num_slots: int, view_bytes: int = 0):
        # one more slot (`pad`) holds zeros for the masked columns of the decode rows' reads
        self.pad = num_slots
        self.view = DecodeView(view_bytes) if view_bytes > 0 else None
        self._slot_bytes = 0
        self.keys: list[torch.Tensor] = [torch.empty(0)] * num_layers  # [S + 1, H, D] each, once written
        self.values: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.layout: StepLayout | None = None
        self._config_of: tuple[Any, Any] | None = None  # (model, its text config)
        self.memo: dict[str, Any] = {}  # what a step's layout keeps for the next (StepLayout._slots)

    def _make(self, like: torch.Tensor) -> torch.Tensor:
        """A layer's slots for tensors like `like` ([1, H, T, D]); empty: pages the OS never
        touched cost no memory until a block is used."""
        # made outside inference mode (the runner's forwards run in it): the slots outlive the
        # forward, and a tensor made in inference mode cannot be written outside it
        with torch.inference_mode(False):
            t = like.new_empty(self.pad + 1, like.shape[1], like.shape[3])
        t[self.pad].zero_()
        return t

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's keys and values ([1, H, T, D]) into their slots; they are
        returned unchanged (`paged_attention` reads the pool)."""
        assert self.layout is not None, "a paged forward runs inside PagedCache.step"
        kp, vp = self.keys[layer_idx], self.values[layer_idx]
        if not kp.numel():
            kp, vp = self.keys[layer_idx], self.values[layer_idx] = self._make(key), self._make(value)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
        if k.dtype != kp.dtype or v.dtype != vp.dtype:
            k, v = k.to(kp.dtype), v.to(vp.dtype)
        kp.index_copy_(0, self.layout.write, k)
        vp.index_copy_(0, self.layout.write, v)
        lay = self.layout
        if lay.view_mode is not None:
            self._to_view(lay, layer_idx, k, v, kp, vp)
        return key, value

    def _to_view(self, lay: StepLayout, layer: int, k: torch.Tensor, v: torch.Tensor, kp: torch.Tensor,
                 vp: torch.Tensor) -> None:
        """The decode rows' part of this forward's keys and values ([T, H, D]) into the view:
        their new column ("append"), or every row's context gathered from the pool ("fill")."""
        view = lay.view
        assert view is not None and lay.dec_span is not None
        a, b = lay.dec_span
        if lay.view_mode == "append":
            kv, vv = view.k[layer], view.v[layer]
            assert kv is not None and vv is not None
            kv[lay.view_rows, :, lay.view_cols] = k[a:b]
            vv[lay.view_rows, :, lay.view_cols] = v[a:b]
            return
        keys, rows = lay.dec_keys, b - a
        for pool, out in ((kp, view.k), (vp, view.v)):
            with torch.inference_mode(False):  # outlives the forward (as the slots: `_make`)
                t = pool.new_zeros(rows, pool.shape[1], view.cap, pool.shape[2])  # [B, H, cap, D]
            gathered = pool.index_select(0, lay.dec_read).view(rows, keys, pool.shape[1], pool.shape[2])
            t[:, :, :keys] = gathered.transpose(1, 2)
            out[layer] = t

    @property
    def slot_bytes(self) -> int:
        """One token slot's bytes over all layers, keys and values (0 until every layer is made)."""
        if not self._slot_bytes and all(t.numel() for t in self.keys):
            self._slot_bytes = sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
                                   for k, v in zip(self.keys, self.values))
        return self._slot_bytes

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @contextlib.contextmanager
    def step(self, model: Any, layout: StepLayout) -> Iterator[None]:
        """Run a packed forward of `layout` over this cache: the model's attention is
        `paged_attention` inside, what it was after."""
        text = self._text_config(model)
        before = text._attn_implementation
        self.layout = layout
        _set_attention(text, ATTENTION)
        try:
            yield
        finally:
            _set_attention(text, before)
            self.layout = None

    def _text_config(self, model: Any) -> Any:
        """`model`'s text config, looked up once per model (get_text_config measured 9 us a call)."""
        if self._config_of is None or self._config_of[0] is not model:
            self._config_of = (model, model.config.get_text_config())
        return self._config_of[1]


def _set_attention(config: Any, name: str) -> None:
    """Set a config's attention implementation. A config without sub-configs takes it in its
    attribute directly: the property's setter goes through the strict dataclass checks of
    `huggingface_hub` (10 us against 1 us a call, twice a step)."""
    if config.sub_configs:
        config._attn_implementation = name
    else:
        vars(config)["_attn_implementation_internal"] = name


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of a packed forward (query [1, Q, T, D], this forward's keys and values [1, H, T, D])
    over each row's slots; returns [1, T, Q, D]."""
    cache: PagedCache = kwargs["moeflow_cache"]
    layout = cache.layout
    assert layout is not None
    layer = cast(int, module.layer_idx)  # transformers' attention modules know their layer
    kp, vp = cache.keys[layer], cache.values[layer]  # [S, H, D]
    heads_q, d = query.shape[1], query.shape[3]
    heads_kv, dv = kp.shape[1], vp.shape[2]  # the values' head dim may differ (latent attention)
    group = heads_q // heads_kv
    q = query[0]  # [Q, T, D]
    b = layout.dec_rows
    if b and layout.dec_all:
        return _decode(layout, layer, q, kp, vp, scaling).unsqueeze(0), None
    out = query.new_empty(q.shape[1], heads_q, dv)  # [T, Q, Dv]
    if b:
        span = layout.dec_span
        if span is not None:
            out[span[0]:span[1]] = _decode(layout, layer, q[:, span[0]:span[1]], kp, vp, scaling)
        else:
            assert layout.dec_pos is not None
            out[layout.dec_pos] = _decode(layout, layer, q.index_select(1, layout.dec_pos), kp, vp, scaling)
    for start, rows, n in layout.fresh:
        # prompts with nothing cached: their own keys, causal, one batch of `rows` x `n` tokens
        end = start + rows * n
        qp = q[:, start:end].view(heads_q, rows, n, d).transpose(0, 1)  # [rows, Q, n, D]
        k = key[0, :, start:end].view(heads_kv, rows, n, d).transpose(0, 1)  # [rows, H, n, D]
        v = value[0, :, start:end].view(heads_kv, rows, n, dv).transpose(0, 1)
        o = F.scaled_dot_product_attention(qp, k.to(qp.dtype), v.to(qp.dtype), is_causal=True, scale=scaling,
                                           enable_gqa=group > 1)  # [rows, Q, n, Dv]
        out[start:end] = o.transpose(1, 2).reshape(rows * n, heads_q, dv)
    for row, read, mask in layout.chunks:
        # 4-D [1, heads, tokens, D] with the kv heads as they are (enable_gqa): torch's CPU flash
        # kernel takes that shape with or without a mask; a 3-D call falls back to the math path,
        # which materialises every [Q, C, L] score and measured 15-25x slower at a 4,096 context
        qp = q[None, :, row.start:row.start + row.n]  # [1, Q, C, D]
        k = kp.index_select(0, read).transpose(0, 1)[None]  # [1, H, L, D]
        v = vp.index_select(0, read).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qp, k.to(qp.dtype), v.to(qp.dtype), attn_mask=mask, scale=scaling,
                                           enable_gqa=group > 1)
        out[row.start:row.start + row.n] = o[0].transpose(0, 1)  # [C, Q, Dv]
    return out.unsqueeze(0), None


def _decode(layout: StepLayout, layer: int, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
            scaling: float | None) -> torch.Tensor:
    """The decode rows' attention, one SDPA call: q [Q, B, D] -> [B, Q, Dv].

    Each row's keys and values come from the decode view (DecodeView) where the step uses it,
    else they are gathered from the pool with `index_select` over the flat [B * L] slot list
    (measured 14 against 62 us for 16 rows' keys and values by a 2-D advanced index); one kv
    head's query heads are packed as query rows."""
    heads_q, b, d = q.shape
    heads_kv, dv, keys = kp.shape[1], vp.shape[2], layout.dec_keys
    qd = q.transpose(0, 1).reshape(b, heads_kv, heads_q // heads_kv, d)  # [B, H, group, D]
    view = layout.view
    if view is not None:
        k, v = view.k[layer], view.v[layer]  # [B, H, cap, D]
        assert k is not None and v is not None
        bias = view.mask(qd.dtype, qd.device)
    else:
        k = kp.index_select(0, layout.dec_read).view(b, keys, heads_kv, d).transpose(1, 2)  # [B, H, L, D]
        v = vp.index_select(0, layout.dec_read).view(b, keys, heads_kv, dv).transpose(1, 2)
        bias = layout.bias(qd.dtype)
    if k.dtype != qd.dtype:
        k, v = k.to(qd.dtype), v.to(qd.dtype)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=bias, scale=scaling)  # [B, H, group, Dv]
    return o.reshape(b, heads_q, dv)


def register() -> None:
    """Make `paged_attention` selectable by name (transformers' AttentionInterface)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)
