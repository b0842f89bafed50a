"""Prefix caching (vLLM's automatic prefix caching) over the engine's transformers caches.

A prompt is cut into full blocks of `block_size` tokens; each block is named
by a chain hash of the block before it, its tokens and the adapter (LoRA
changes the keys and values), as vLLM names its blocks. When a prompt's
prefill completes, the keys and values of its full blocks are copied into the
pool (per layer [H, block, D]); a later prompt whose leading blocks match
starts with a cache built from them and prefills only the rest (its last
prompt token is always computed: its logits give the first output token).
The pool holds at most `num_blocks` blocks, the least recently used evicted
first. A block is found by its hash and checked against its tokens, adapter
and parent, so a hash collision is a miss, never a wrong cache.

Only caches of plain full-attention layers (`KVBatch.plain`): a sliding
window drops early columns and a linear-attention state is not per token, so
those models keep prefilling every prompt (a line in the log says so once).

Axis legend: H kv heads, N cached tokens, D head dim.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moeflow.serving.kv_cache import KVBatch

if TYPE_CHECKING:
    from moeflow.serving.request import Sequence

log = logging.getLogger("moeflow.serving")


@dataclass(eq=False)
class Block:
    parent: int | None  # the hash of the block before (None: the first)
    tokens: tuple[int, ...]
    adapter: str | None
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [H, block, D]


class PrefixCache:
    """Full prompt blocks' keys and values by chain hash, LRU-bounded.

    Args:
        block_size: tokens per block (vLLM's default: 16).
        num_blocks: blocks kept at most.
    """

    def __init__(self, block_size: int, num_blocks: int):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        self.queried_tokens = self.hit_tokens = 0  # prompt tokens looked up / found (hit rate)
        self._refused = False
        self.template: Any = None  # an empty cache of the served model (its layer classes), once one was stored

    def _chain(self, tokens: list[int], adapter: str | None) -> list[tuple[int | None, int, tuple[int, ...]]]:
        """(parent hash, hash, tokens) of every full block of `tokens`."""
        bs = self.block_size
        out: list[tuple[int | None, int, tuple[int, ...]]] = []
        parent: int | None = None
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, adapter, chunk))
            out.append((parent, h, chunk))
            parent = h
        return out

    def lookup(self, seq: "Sequence") -> KVBatch | None:
        """A cache of the longest cached prefix of `seq`'s prompt (all but its last token), or None."""
        self.queried_tokens += seq.num_prompt
        if self.template is None:  # nothing stored yet
            return None
        found: list[Block] = []
        for parent, h, chunk in self._chain(seq.tokens[:seq.num_prompt - 1], seq.adapter):
            block = self.blocks.get(h)
            if block is None or (block.parent, block.tokens, block.adapter) != (parent, chunk, seq.adapter):
                break
            self.blocks.move_to_end(h)
            found.append(block)
        if not found:
            return None
        n = len(found) * self.block_size
        self.hit_tokens += n
        layers = [(torch.cat([b.layers[i][0] for b in found], dim=1).unsqueeze(0),   # [1, H, N, D]
                   torch.cat([b.layers[i][1] for b in found], dim=1).unsqueeze(0))
                  for i in range(len(found[0].layers))]
        mask = torch.ones(1, n, dtype=torch.long, device=layers[0][0].device)  # [1, N]
        return KVBatch(self.template._rebuild(layers, n), mask, [seq], True)

    def store(self, seq: "Sequence") -> None:
        """Copy the full blocks of `seq`'s prompt from its cache (its prefill just completed)."""
        kv = seq.kv
        if kv is None or not kv.plain():
            if not self._refused and kv is not None:
                self._refused = True
                log.info("prefix caching off for this model: its cache layers are not all plain full "
                         "attention (sliding windows or linear-attention states); every prompt is prefilled")
            return
        row = kv.seqs.index(seq)
        cols = kv.mask[row].nonzero().flatten()  # this row's real columns (pads may sit anywhere)
        if len(cols) < seq.num_prompt or kv.cache.layers[0].keys.shape[2] != kv.width:
            return
        if self.template is None:  # the layer classes only: no tensor of this cache is kept
            empty = [(layer.keys.new_empty((0, *layer.keys.shape[1:])),
                      layer.values.new_empty((0, *layer.values.shape[1:]))) for layer in kv.cache.layers]
            self.template = KVBatch(kv._rebuild(empty, 0), kv.mask[:0], [], True)
        bs = self.block_size
        for j, (parent, h, chunk) in enumerate(self._chain(seq.tokens[:seq.num_prompt], seq.adapter)):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            idx = cols[j * bs:(j + 1) * bs].to(kv.cache.layers[0].keys.device)
            layers = [(layer.keys[row][:, idx].clone(), layer.values[row][:, idx].clone())  # [H, block, D]
                      for layer in kv.cache.layers]
            self.blocks[h] = Block(parent, chunk, seq.adapter, layers)
            while len(self.blocks) > self.num_blocks:
                self.blocks.popitem(last=False)
