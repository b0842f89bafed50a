"""The KV cache manager's bookkeeping: a pool of fixed-size blocks, reference counts, prefix caching.

vLLM V1's design (its `BlockPool` and `KVCacheManager`), on the engine's own
paged cache (paged.py holds the tensors; this file only numbers blocks):

- the cache is `num_blocks` blocks of `block_size` token slots; a sequence
  holds a block table (its blocks in order, token `p` at slot
  `table[p // block_size] * block_size + p % block_size`);
- a block has a reference count: the sequences whose tables hold it. A
  sequence that finishes or is preempted drops its references; a block no
  one references is free;
- prefix caching: a full block is named by a chain hash of the block before
  it, its tokens and the adapter (LoRA changes keys and values). A sequence
  admitted with a prompt whose leading full blocks are named in the pool
  takes references to those blocks and starts computing after them (its last
  prompt token is always computed: its logits give the first output token).
  Free blocks that carry a name stay in an LRU and are reused by name until
  a block is needed and none is unnamed, then the least recently freed one
  loses its name. A hit is checked against the block's tokens, parent and
  adapter, so a hash collision is a miss, never a wrong cache.

Written here, not taken from transformers' continuous batching: its
`PagedAttentionCache` allocates per request state of its own scheduler
(`RequestState`) and has no adapter in its block names; the engine's scheduler
decides admission and preemption itself (scheduler.py, engine_core.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["BlockPool", "NoFreeBlocks"]


class NoFreeBlocks(Exception):
    """The pool cannot give the blocks asked for (the engine preempts a sequence)."""


@dataclass(eq=False)
class BlockName:
    parent: int | None  # the hash of the block before (None: the first)
    tokens: tuple[int, ...]
    adapter: str | None
    hash: int = 0


@dataclass
class Table:
    """One sequence's blocks and how many of its full blocks carry a name."""

    blocks: list[int] = field(default_factory=list)
    named: int = 0  # leading full blocks hashed so far
    parent: int | None = None  # the hash of the last of them


class BlockPool:
    """Blocks of `block_size` token slots, reference counted, named by chain hash when full.

    Args:
        num_blocks: blocks in the cache.
        block_size: token slots per block.
        prefix_caching: name full blocks and reuse them (vLLM's enable_prefix_caching).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # unnamed free blocks (a stack)
        self.cached: OrderedDict[int, None] = OrderedDict()  # named free blocks, least recently freed first
        self.name_of: dict[int, BlockName] = {}  # block -> its name (full, hashed blocks)
        self.by_hash: dict[int, int] = {}  # hash -> block
        self.tables: dict[int, Table] = {}  # id(sequence) -> its table
        self.queried_tokens = self.hit_tokens = 0  # prompt tokens looked up / found (vLLM's hit rate)

    # ------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (unnamed free + named free)."""
        return len(self.free) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks referenced by a sequence (the KV usage metric's numerator)."""
        return self.num_blocks - self.num_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------ prefix caching

    def _chain(self, tokens: list[int], adapter: str | None, start: int = 0,
               parent: int | None = None) -> list[BlockName]:
        bs = self.block_size
        out: list[BlockName] = []
        for i in range(start, len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            name = BlockName(parent, chunk, adapter, hash((parent, adapter, chunk)))
            out.append(name)
            parent = name.hash
        return out

    def hits(self, tokens: list[int], adapter: str | None) -> list[int]:
        """The blocks holding the longest cached prefix of `tokens` (all but the last token)."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        for name in self._chain(tokens[:len(tokens) - 1], adapter):
            block = self.by_hash.get(name.hash)
            have = self.name_of.get(block) if block is not None else None
            if have is None or (have.parent, have.tokens, have.adapter) != (name.parent, name.tokens, name.adapter):
                break
            found.append(block)  # type: ignore[arg-type]
        return found

    # ------------------------------------------------------------ one sequence

    def admit(self, key: int, tokens: list[int], adapter: str | None, hit: list[int]) -> int:
        """Open a table for a sequence starting with the cached blocks `hit` (from `hits`);
        returns the tokens they hold (the sequence computes from there)."""
        table = self.tables[key] = Table()
        for block in hit:
            self._ref(block)
            table.blocks.append(block)
        table.named = len(hit)
        table.parent = self.name_of[hit[-1]].hash if hit else None
        if self.prefix_caching:
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(hit) * self.block_size
        return len(hit) * self.block_size

    def grow(self, key: int, tokens: int) -> None:
        """Make the sequence's table hold `tokens` tokens (all or nothing); NoFreeBlocks if short."""
        table = self.tables[key]
        need = -(-tokens // self.block_size) - len(table.blocks)
        if need <= 0:  # most calls: a decode step within the sequence's last block
            return
        if need > self.num_free:
            raise NoFreeBlocks(f"{need} blocks needed, {self.num_free} free")
        for _ in range(need):
            table.blocks.append(self._take())

    def name_full(self, key: int, tokens: list[int], computed: int, adapter: str | None) -> None:
        """Name the sequence's full blocks among its first `computed` tokens (prefix caching)."""
        table = self.tables.get(key)
        if not self.prefix_caching or table is None:
            return
        full = computed // self.block_size
        if full <= table.named:
            return
        for i, name in enumerate(self._chain(tokens[:full * self.block_size], adapter, table.named, table.parent),
                                 start=table.named):
            block = table.blocks[i]
            # the same content in another block may carry the name already (two prompts prefilled
            # at once): then this block stays unnamed, and the chain goes on by hash
            if name.hash not in self.by_hash and block not in self.name_of:
                self.by_hash[name.hash] = block
                self.name_of[block] = name
            table.parent = name.hash
        table.named = full

    def release(self, key: int) -> None:
        """The sequence is done with its blocks (finished, aborted, preempted)."""
        table = self.tables.pop(key, None)
        if table is None:
            return
        for block in reversed(table.blocks):  # the tail first: it is the least likely to be shared
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.name_of and self.by_hash.get(self.name_of[block].hash) == block:
                    self.cached[block] = None
                else:
                    self.name_of.pop(block, None)
                    self.free.append(block)

    def table(self, key: int) -> list[int]:
        return self.tables[key].blocks

    # ------------------------------------------------------------ blocks

    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cached.pop(block, None)
        self.refs[block] += 1

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.cached.popitem(last=False)  # least recently freed named block loses its name
            name = self.name_of.pop(block)
            if self.by_hash.get(name.hash) == block:
                del self.by_hash[name.hash]
        self.refs[block] = 1
        return block
