"""Physical KV blocks: who holds them (reference counts) and which one to hand out next.

Every block is in exactly one of three states:

    used        refcount > 0: in at least one request's block table
    cached      refcount == 0, but it still holds a prefix-cache entry: reusable by a later
                request with the same prefix, and evictable (least recently released first)
    free        refcount == 0, holding nothing worth keeping

allocate() takes the free block with the lowest id, and only when none is left evicts the least
recently used cached one (telling the prefix cache through `on_evict`). Keeping cached blocks
around costs nothing until memory runs short, which is the whole point of prefix caching.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from kvserve.paging.errors import BlockAllocatorError, NoFreeBlocksError

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)


def validate_block_size(block_size: int) -> None:
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")


class BlockAllocator:
    """Allocate / incref / release over `num_blocks` blocks of `block_size` tokens (O(log n) for a
    free block, O(1) otherwise).

    It also tracks how many token positions each block holds (`mark_filled`), so the stats can
    report internal fragmentation (slots allocated but not holding a token) without a scan.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, on_evict: Callable[[int], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        validate_block_size(block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._on_evict = on_evict
        self._refcounts = [0] * num_blocks
        # A min-heap: the lowest free id goes out first. A request's blocks then tend to sit next
        # to each other in memory even after many requests have come and gone, and attention
        # streams adjacent blocks faster: handing released blocks out in release order instead
        # (first in, first out) scatters them, which cost a long-running engine 3-8% of its W64
        # throughput (benchmarks/repeated_runs.py). The order is also predictable, which makes
        # exact-block-id tests possible.
        self._free: list[int] = list(range(num_blocks))
        # Insertion order is release order: the first key is the least recently used.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._fill = [0] * num_blocks
        self._tokens_in_used = 0

    # --- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out: the free ones plus the evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def tokens_in_used_blocks(self) -> int:
        return self._tokens_in_used

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcounts[block_id]

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached

    def cached_lru_order(self) -> list[int]:
        """Cached-free blocks, the next to be evicted first."""
        return list(self._cached)

    # --- transitions --------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block with refcount 1 and no tokens; evicts the LRU cached block if none is free."""
        if self._free:
            block_id = heapq.heappop(self._free)
        elif self._cached:
            block_id, _ = self._cached.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(block_id)
        else:
            raise NoFreeBlocksError(self.num_blocks)
        self._refcounts[block_id] = 1
        self._fill[block_id] = 0
        return block_id

    def incref(self, block_id: int) -> None:
        """Take one more reference. A cached-free block comes back into use (and keeps its tokens)."""
        self._check_id(block_id)
        if self._refcounts[block_id] == 0:
            if block_id not in self._cached:
                raise BlockAllocatorError(
                    f"block {block_id} is free and holds nothing: allocate() it instead of taking a reference"
                )
            del self._cached[block_id]
            self._tokens_in_used += self._fill[block_id]
        self._refcounts[block_id] += 1

    def release(self, block_id: int, keep_cached: bool = False) -> None:
        """Drop one reference. At zero the block becomes cached (evictable, most recently used)
        when `keep_cached`, otherwise free."""
        self._check_id(block_id)
        if self._refcounts[block_id] == 0:
            raise BlockAllocatorError(
                f"block {block_id} was released more times than it was referenced (double free, or an id "
                "this allocator never handed out); each allocate()/incref() allows exactly one release()"
            )
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] > 0:
            return
        self._tokens_in_used -= self._fill[block_id]
        if keep_cached:
            self._cached[block_id] = None
        else:
            self._fill[block_id] = 0
            heapq.heappush(self._free, block_id)

    def mark_filled(self, block_id: int, num_tokens: int) -> None:
        """Record that a used block holds at least `num_tokens` positions (it never shrinks)."""
        if not 0 <= num_tokens <= self.block_size:
            raise ValueError(f"a block holds 0..{self.block_size} tokens, got {num_tokens}")
        self._check_id(block_id)
        if self._refcounts[block_id] == 0:
            raise BlockAllocatorError(f"block {block_id} is not in use; only a used block can be filled")
        self.fill_held(block_id, num_tokens)

    def is_shared(self, block_id: int) -> bool:
        """Whether more than one block table holds the block (unchecked: for ids taken from a table)."""
        return self._refcounts[block_id] > 1

    def fill_held(self, block_id: int, num_tokens: int) -> None:
        """mark_filled without its checks, for the per-step path: the caller took `block_id`
        from a block table (so it is valid and in use) and `num_tokens` from a position inside
        that block (so it is within 1..block_size)."""
        grown = num_tokens - self._fill[block_id]
        if grown > 0:
            self._fill[block_id] = num_tokens
            self._tokens_in_used += grown

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockAllocatorError(f"block id {block_id} is out of range: this allocator has blocks 0..{self.num_blocks - 1}")
