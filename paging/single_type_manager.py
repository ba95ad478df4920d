"""One layer group's block tables over the shared pool (vLLM v1's SingleTypeKVCacheManager).

Each group has its own prefix cache (its block ids hold its own layers' K/V) and draws blocks
from the allocator every group shares. What differs between kinds of layers lives here, in one
small class per kind: which cached blocks a prefix hit needs, and which blocks a request may give
back while it runs.

The KVCacheManager plans an allocation for all groups first and then carries it out, so a
request either gets its blocks in every group or changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.paging.block_allocator import BlockAllocator
from kvserve.paging.block_table import BlockTable
from kvserve.paging.prefix_cache import BlockHash, PrefixCache


@dataclass(frozen=True)
class GrowthPlan:
    """What one table needs before a step writes positions [first_block * size, end): copies of
    the shared blocks it writes into, and blocks appended."""

    shared: list[int]  # logical indices of blocks to copy before writing
    num_missing: int

    @property
    def num_blocks(self) -> int:
        return len(self.shared) + max(0, self.num_missing)


class FullAttentionManager:
    """Full attention reads every earlier token: a hit needs every block of the prefix, and no
    block is given back before the request ends. Other kinds subclass it and change just that."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = PrefixCache(block_size)
        # Copy-on-write pairs (source, destination) queued for the runner.
        self.blocks_to_copy: list[tuple[int, int]] = []

    def find_longest_cache_hit(self, token_ids: Sequence[int], hashes: list[BlockHash], root: BlockHash,
                               max_blocks: int) -> list[int]:
        """Block ids of the longest verified cached prefix of at most `max_blocks` full blocks."""
        return self.prefix_cache.lookup(token_ids, hashes, root, max_blocks)

    def plan_growth(self, table: BlockTable, num_computed_tokens: int, end: int) -> GrowthPlan:
        """Copy-on-write: blocks the step writes into that another request also holds, or that
        the prefix cache holds (its tokens are promised to future hits). Normally that is the
        partial block a fork shares; a cached block is only written after a fork that ends
        mid-block, once its other holders are gone. Usually one block is written: a decode's."""
        num_blocks_needed = -(-end // self.block_size)
        allocator, cache = self.allocator, self.prefix_cache
        shared = [index for index in range(num_computed_tokens // self.block_size, min(len(table), num_blocks_needed))
                  if allocator.refcount(table[index]) > 1 or cache.is_cached(table[index])]
        return GrowthPlan(shared, num_blocks_needed - len(table))

    def grow(self, table: BlockTable, plan: GrowthPlan, num_computed_tokens: int, end: int) -> list[int]:
        """Carries out a plan that fits: copies for shared blocks, new blocks, fill counts.
        Returns the block ids appended to the table."""
        size = self.block_size
        allocator = self.allocator
        for index in plan.shared:
            copy = allocator.allocate()
            source = table.replace_block(index, copy)
            allocator.release(source, keep_cached=self.prefix_cache.is_cached(source))
            allocator.mark_filled(copy, min(size, max(0, num_computed_tokens - index * size)))
            self.blocks_to_copy.append((source, copy))
        appended = [allocator.allocate() for _ in range(plan.num_missing)]
        for block_id in appended:
            table.append_block(block_id)
        for index in range(num_computed_tokens // size, -(-end // size)):
            allocator.mark_filled(table[index], min(size, end - index * size))
        if end > table.num_tokens:
            table.append_tokens(end - table.num_tokens)
        return appended

    def register_full_blocks(self, table: BlockTable, hashes: Sequence[BlockHash], root: BlockHash,
                             token_ids: Sequence[int], first: int, num_full: int) -> None:
        """Offer the table's blocks first .. num_full-1, which just became full, to the prefix cache."""
        size = self.block_size
        for index in range(first, num_full):
            parent = hashes[index - 1] if index else root
            self.prefix_cache.register(table[index], hashes[index], parent, token_ids[index * size:(index + 1) * size])

    def free(self, table: BlockTable) -> None:
        # Last block first: released blocks join the LRU in this order, so a finished request's
        # tail (the part least likely to be shared) is evicted before its prefix.
        for block_id in reversed(table.block_ids):
            self.allocator.release(block_id, keep_cached=self.prefix_cache.is_cached(block_id))
        if self.blocks_to_copy:
            self.blocks_to_copy = [(src, dst) for src, dst in self.blocks_to_copy if self.allocator.refcount(dst) > 0]

    def fork(self, table: BlockTable, num_tokens: int) -> BlockTable:
        """A table sharing (by reference) `table`'s blocks that cover its first num_tokens positions."""
        shared = table.block_ids[: -(-num_tokens // self.block_size)]
        for block_id in shared:
            self.allocator.incref(block_id)
        return BlockTable(self.block_size, shared, num_tokens)

