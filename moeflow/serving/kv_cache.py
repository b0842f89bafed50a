"""KV cache of the local engine: persistent left-padded batches over transformers' own cache.

A `KVBatch` is a set of sequences decoded together: one transformers cache
whose rows are the sequences, right-aligned (left-padded) as `generate` keeps
a batch, plus the 2-D attention mask that marks each row's real tokens. A
decode step appends one column to every layer in place (the cache's own
`update`, one copy per step, as in `generate`); the batch is re-laid only when
its membership changes (rows finish or join).

Which caches can be batched this way is read from the cache the model itself
builds (no per-family table): a `DynamicCache` whose layers are all plain or
sliding-window attention (`DynamicLayer`, `DynamicSlidingWindowLayer`) can be
merged and split row-wise. Any other cache (linear-attention/state-space
layers of hybrid models, indexer caches, a model's own cache class) stays
with its one sequence, which then decodes alone: correct for every model
transformers can run, batched where the cache allows it.

Axis legend: B rows, W cached columns (pads included), H kv heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch


def batchable(cache) -> bool:
    """True when `cache` is a DynamicCache of plain / sliding-window attention layers only."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    if type(cache) is not DynamicCache or not cache.layers:
        return False
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) and getattr(layer, "is_initialized", False)
               for layer in cache.layers)


class KVBatch:
    """Rows decoded together: a transformers cache + the mask of real tokens.

    Args:
        cache: the model's cache object for these rows ([B, H, W, D] per layer when mergeable).
        mask: [B, W] long, 1 where a cached column is a real token of that row.
        seqs: the engine's sequences, one per row.
        mergeable: whether rows can be split off and merged with other batches (see `batchable`).
    """

    def __init__(self, cache, mask: torch.Tensor, seqs: list, mergeable: bool):
        self.cache, self.mask, self.seqs, self.mergeable = cache, mask, list(seqs), mergeable

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def compact(self) -> "KVBatch":
        """Lay every layer's keys and values out contiguously (a prefill leaves the attention's
        transposed views): every decode step then sees one memory layout, so a compiled forward
        (deploy.compile) needs one graph, not one per layout. A copy of the prompt's cache only
        (the next step's append copies it anyway). Mergeable caches only; returns self."""
        if self.mergeable:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
        return self

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------ fault isolation

    def snapshot(self) -> Any:
        """What `restore` needs to undo a forward that failed half way (tensor references only:
        `update` replaces a layer's tensors, it never writes into them)."""
        if not self.mergeable:
            return None
        return [(layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in self.cache.layers]

    def restore(self, snap: Any) -> None:
        if snap is None:
            return
        for layer, (k, v, n) in zip(self.cache.layers, snap):
            layer.keys, layer.values = k, v
            if n is not None:
                layer.cumulative_length = n

    # ------------------------------------------------------------ membership

    def select(self, rows: list[int]) -> "KVBatch":
        """A new batch of these rows (in this order), leading all-pad columns dropped."""
        if not self.mergeable:
            if rows != list(range(len(self.seqs))):
                raise ValueError("this cache cannot be split by rows")
            return self
        idx = torch.tensor(rows, device=self.mask.device)
        mask = self.mask[idx]  # [B', W]
        real = mask.any(dim=0).nonzero()
        drop = int(real[0]) if len(real) else 0  # columns that are padding in every kept row
        width = mask.shape[1] - drop
        layers = []
        for layer in self.cache.layers:
            k, v = layer.keys[idx.to(layer.keys.device)], layer.values[idx.to(layer.values.device)]
            keep = min(k.shape[2], width)  # a sliding layer holds at most its window
            # contiguous: the next step's cat copies them anyway, and a compiled decode
            # (deploy.compile) would otherwise compile again for the sliced strides
            layers.append((k[:, :, k.shape[2] - keep:].contiguous(), v[:, :, v.shape[2] - keep:].contiguous()))
        return KVBatch(self._rebuild(layers, width), mask[:, drop:], [self.seqs[i] for i in rows], True)

    def _rebuild(self, layers: list[tuple[torch.Tensor, torch.Tensor]], width: int):
        """A cache of this one's layer types holding `layers`, `width` columns seen per row."""
        # lazy: transformers: heavy, loaded only when this runs
        from transformers import DynamicCache

        cache = DynamicCache.__new__(DynamicCache)
        cache.__dict__.update(self.cache.__dict__)
        cache.layers = []
        for old, (k, v) in zip(self.cache.layers, layers):
            cls: Any = type(old)
            new = cls.__new__(cls)
            new.__dict__.update(old.__dict__)
            new.keys, new.values = k, v
            if hasattr(new, "cumulative_length"):
                new.cumulative_length = width
            cache.layers.append(new)
        return cache

    @staticmethod
    def merge(batches: list["KVBatch"]) -> "KVBatch":
        """One batch of all rows, right-aligned to the widest (left padding added)."""
        if len(batches) == 1:
            return batches[0]
        width = max(b.width for b in batches)
        masks = [torch.nn.functional.pad(b.mask, (width - b.width, 0)) for b in batches]  # [B_i, W]
        layers = []
        for i in range(len(batches[0].cache.layers)):
            ks = [b.cache.layers[i].keys for b in batches]
            vs = [b.cache.layers[i].values for b in batches]
            cols = max(k.shape[2] for k in ks)
            ks = [torch.nn.functional.pad(k, (0, 0, cols - k.shape[2], 0)) for k in ks]  # [B_i, H, cols, D]
            vs = [torch.nn.functional.pad(v, (0, 0, cols - v.shape[2], 0)) for v in vs]
            layers.append((torch.cat(ks), torch.cat(vs)))
        seqs = [s for b in batches for s in b.seqs]
        return KVBatch(batches[0]._rebuild(layers, width), torch.cat(masks), seqs, True)

    def plain(self) -> bool:
        """Every layer a plain full-attention `DynamicLayer` (no window: a masked column in the
        middle of a row costs no real token its place)."""
        # lazy: transformers: heavy, loaded only when this runs
        from transformers.cache_utils import DynamicLayer

        return self.mergeable and all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def with_empty_rows(self, n: int) -> Any:
        """A copy of the cache with `n` more rows whose every column is padding (zeros), for
        prompts that join this batch in a mixed forward; this batch's own cache is untouched."""
        layers = []
        for layer in self.cache.layers:
            k, v = layer.keys, layer.values  # [B, H, W, D]
            layers.append((torch.cat([k, k.new_zeros(n, *k.shape[1:])]),
                           torch.cat([v, v.new_zeros(n, *v.shape[1:])])))
        return self._rebuild(layers, self.width)

    def grow_mask(self, columns: int) -> torch.Tensor:
        """The mask with `columns` new real columns for every row (the forward's attention_mask)."""
        ones = self.mask.new_ones(self.mask.shape[0], columns)
        return torch.cat([self.mask, ones], dim=1)  # [B, W + columns]
