"""The engine core's KV cache manager: the paged cache, its block pool, admission and preemption.

vLLM V1's `KVCacheManager` for the models paged.py can page: the block pool
(block_pool.py) numbers the blocks and their references, `PagedCache`
(paged.py) holds the keys and values. The scheduler admits a waiting sequence
only when the pool can hold its prompt (`fits`, after its cached prefix);
before each forward the step's rows get the blocks their new tokens need
(`grow`), and when the pool runs dry the most recently admitted running
sequence is preempted (vLLM's recompute preemption: its blocks are freed and
it waits again at the head of the queue, to be prefilled anew over its prompt
and the tokens it had made). The KV usage metric is blocks used / blocks.

Axis legend: S slots.
"""

from __future__ import annotations

from typing import Any

import torch

from moeflow.serving.block_pool import BlockPool
from moeflow.serving.paged import PagedCache, register
from moeflow.serving.request import Sequence

__all__ = ["KVCacheManager"]


class KVCacheManager:
    """Blocks of the paged cache for the core's sequences.

    Args:
        model: the served transformers model (its config gives the cache's shape).
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        prefix_caching: reuse full blocks by their chain hash (vLLM's enable_prefix_caching).
        view_bytes: the decode view's budget (paged.DecodeView); 0: none.
    """

    def __init__(self, model: Any, num_blocks: int, block_size: int, prefix_caching: bool, view_bytes: int = 0):
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        self.cache = PagedCache(model.config.get_text_config().num_hidden_layers, num_blocks * block_size,
                                view_bytes)
        self.block_size = block_size
        register()

    @property
    def usage(self) -> float:
        """Blocks used / blocks (vLLM's kv_cache_usage_perc)."""
        return self.pool.used / self.pool.num_blocks

    def fits(self, seq: Sequence) -> bool:
        """Admit `seq` if the pool can hold its tokens beyond a cached prefix; on admission its
        table opens with that prefix (`num_cached` counts it) and the blocks for the rest."""
        cacheable = seq.image is None and seq.params.prompt_logprobs is None  # those need every position
        hit = self.pool.hits(seq.tokens, seq.adapter) if cacheable else []
        # the hit blocks that sit free in the LRU are counted as free: taking them uses them up
        reused_free = sum(1 for b in hit if self.pool.refs[b] == 0)
        need = self.pool.blocks_for(len(seq.tokens)) - len(hit)
        if need > self.pool.num_free - reused_free:
            return False
        seq.num_cached = self.pool.admit(id(seq), seq.tokens, seq.adapter, hit)
        self.pool.grow(id(seq), len(seq.tokens))  # its prompt's blocks now: later admissions see them taken
        return True

    def grow(self, seq: Sequence, n: int) -> None:
        """Blocks for `n` more tokens of `seq` (NoFreeBlocks: the pool is dry)."""
        self.pool.grow(id(seq), seq.num_cached + n)

    def slots(self, seq: Sequence, upto: int) -> torch.Tensor:
        """The slots of `seq`'s first `upto` tokens [upto]."""
        table = torch.tensor(self.pool.table(id(seq)))
        return (table[:, None] * self.block_size + torch.arange(self.block_size)).flatten()[:upto]

    def computed(self, seq: Sequence) -> None:
        """`seq`'s forward succeeded: name its full blocks (prefix caching)."""
        self.pool.name_full(id(seq), seq.tokens, seq.num_cached, seq.adapter)

    def free(self, seq: Sequence) -> None:
        """`seq` finished, failed or was preempted: its blocks go back to the pool."""
        self.pool.release(id(seq))
