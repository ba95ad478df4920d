"""One layer group's block tables over the shared pool (vLLM v1's SingleTypeKVCacheManager).

Each group has its own prefix cache (its block ids hold its own layers' K/V) and draws blocks
from the allocator every group shares. What differs between kinds of layers lives here, in one
small class per kind: which cached blocks a prefix hit needs, and which blocks a request may give
back while it runs.

The KVCacheManager plans an allocation for all groups first and then carries it out, so a
request either gets its blocks in every group or changes nothing (but for the blocks a window
group gives back, which the request can never read again).

    kind                 a prefix hit of h blocks needs      blocks given back while running
    full attention       blocks 0 .. h-1                     none
    sliding window (w)   the last ceil((w-1)/B) of them      those wholly before the window of
                                                             the step's first query (-> None)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.paging.block_allocator import BlockAllocator
from kvserve.paging.block_table import BlockTable
from kvserve.paging.kv_cache_spec import KVCacheSpec, SlidingWindowSpec
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

    gives_back_blocks = False  # whether remove_skipped_blocks can free anything

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = PrefixCache(block_size)
        # Copy-on-write pairs (source, destination) queued for the runner.
        self.blocks_to_copy: list[tuple[int, int]] = []

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, allocator: BlockAllocator, block_size: int) -> FullAttentionManager:
        return cls(allocator, block_size)

    def find_longest_cache_hit(self, token_ids: Sequence[int], hashes: list[BlockHash], root: BlockHash,
                               max_blocks: int) -> list[int | None]:
        """Block ids of the longest verified cached prefix of at most `max_blocks` full blocks
        (None for a block the kind does not need)."""
        return list(self.prefix_cache.lookup(token_ids, hashes, root, max_blocks))

    def remove_skipped_blocks(self, table: BlockTable, num_computed_tokens: int) -> None:
        """Give back the blocks no query from `num_computed_tokens` on can read: none here."""

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
            block_id = table[index]
            if block_id is None:  # given back (a window group): its tokens were registered when it filled
                continue
            parent = hashes[index - 1] if index else root
            self.prefix_cache.register(block_id, hashes[index], parent, token_ids[index * size:(index + 1) * size])

    def free(self, table: BlockTable) -> None:
        # Last block first: released blocks join the LRU in this order, so a finished request's
        # tail (the part least likely to be shared) is evicted before its prefix.
        for block_id in reversed(table.block_ids):
            if block_id is not None:
                self.allocator.release(block_id, keep_cached=self.prefix_cache.is_cached(block_id))
        if self.blocks_to_copy:
            self.blocks_to_copy = [(src, dst) for src, dst in self.blocks_to_copy if self.allocator.refcount(dst) > 0]

    def fork(self, table: BlockTable, num_tokens: int) -> BlockTable:
        """A table sharing (by reference) `table`'s blocks that cover its first num_tokens positions."""
        shared = table.block_ids[: -(-num_tokens // self.block_size)]
        for block_id in shared:
            if block_id is not None:
                self.allocator.incref(block_id)
        return BlockTable(self.block_size, shared, num_tokens)


class SlidingWindowManager(FullAttentionManager):
    """A window of w positions (query p reads keys p - w + 1 .. p; paging/kv_cache_spec.py's
    SlidingWindowSpec), vLLM v1's SlidingWindowManager:

        positions    0 ....... 15 | 16 ...... 31 | 32 ...... 47 | 48 .. 52     w = 20, next query at 52
        window                               |<------ 33 .. 52 ------->|
        table        None (given back)  | b1           | b2           | b3

    A step whose first query is at position c reads nothing before c - w + 1, and later steps
    read later, so every block wholly before that is given back (released to the pool, cached
    ones stay cached for prefix hits) and its entry becomes None: a request holds at most
    ceil((w - 1) / B) + 1 blocks between decode steps, whatever its length. The runner's copy
    of the table keeps the old ids (step diffs only append); the kernels never read before the
    window, so another request reusing such a block cannot change this one's output.

    A prefix hit of h blocks needs only the blocks holding the w - 1 positions before position
    h * B: the last ceil((w - 1) / B) of them, found by scanning right to left (earlier blocks
    may long have been evicted)."""

    gives_back_blocks = True

    def __init__(self, allocator: BlockAllocator, block_size: int, sliding_window: int) -> None:
        super().__init__(allocator, block_size)
        self.sliding_window = sliding_window
        self._hit_blocks = -(-(sliding_window - 1) // block_size)  # blocks a hit needs before its end

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, allocator: BlockAllocator, block_size: int) -> SlidingWindowManager:
        if not isinstance(spec, SlidingWindowSpec):
            raise TypeError(f"a SlidingWindowManager serves SlidingWindowSpec groups, got {spec!r}")
        return cls(allocator, block_size, spec.sliding_window)

    def find_longest_cache_hit(self, token_ids: Sequence[int], hashes: list[BlockHash], root: BlockHash,
                               max_blocks: int) -> list[int | None]:
        """The longest hit of at most `max_blocks` blocks whose last ceil((w-1)/B) blocks are all
        cached (None before them), or a shorter hit from block 0 on (every block cached: a prefix
        shorter than the window needs all of it)."""
        cache = self.prefix_cache
        cache.extend_hashes(hashes, token_ids, root, max_blocks)
        needed = self._hit_blocks
        if needed == 0:  # a window of one position reads nothing before the query
            return [None] * max_blocks
        run: list[int] = []  # the cached blocks just right of `index`, right to left
        for index in range(max_blocks - 1, -1, -1):
            block_id = cache.cached_block(index, token_ids, hashes, root)
            if block_id is None:
                run = []
                continue
            run.append(block_id)
            if len(run) == needed:
                return [None] * index + run[::-1]
        return run[::-1]  # the run reaching block 0, shorter than the window needs: all of it

    def remove_skipped_blocks(self, table: BlockTable, num_computed_tokens: int) -> None:
        """Give back every block wholly before position num_computed_tokens - w + 1, the first
        that the step's first query (at num_computed_tokens) reads."""
        num_skipped = min(len(table), max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size)
        # Only a prefix is ever given back: the new ones lie between the last None and num_skipped.
        first = num_skipped
        while first > 0 and table[first - 1] is not None:
            first -= 1
        # Oldest first: released blocks join the LRU in this order, and a later prefix hit needs
        # the newer ones (a window's worth before its end).
        for index in range(first, num_skipped):
            block_id = table.drop_block(index)
            self.allocator.release(block_id, keep_cached=self.prefix_cache.is_cached(block_id))

