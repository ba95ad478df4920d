"""The one facade the scheduler uses: block tables per request over a shared, prefix-cached pool.

Per step, for each request it runs, the scheduler calls

    blocks, num_cached = manager.get_computed_blocks(tokens, salt)     # first time only
    block_ids = manager.allocate_slots(request_id, tokens, num_computed, num_new, blocks, salt)
    if block_ids is None: preempt someone (manager.free(victim)) and retry, or wait

and after schedule() it drains `take_blocks_to_copy()` into the SchedulerOutput so the runner
copies copy-on-write blocks before the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.paging.block_allocator import BlockAllocator
from kvserve.paging.block_table import BlockTable
from kvserve.paging.errors import PagingError, UnknownRequestError
from kvserve.paging.prefix_cache import BlockHash, PrefixCache, root_hash


@dataclass(frozen=True)
class KVCacheStats:
    blocks_total: int
    blocks_used: int  # in some request's block table
    blocks_cached: int  # free but still holding a prefix-cache entry (evictable)
    blocks_free: int
    tokens_stored: int  # positions holding a token, over used blocks
    slots_allocated: int  # blocks_used * block_size
    prefix_cache_queries: int  # cumulative, tokens looked up
    prefix_cache_hits: int  # cumulative, tokens found

    def __post_init__(self) -> None:
        if self.blocks_used + self.blocks_cached + self.blocks_free != self.blocks_total:
            raise ValueError(f"block counts do not add up: {self}")

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached-free blocks count as available)."""
        return self.blocks_used / self.blocks_total

    @property
    def fragmentation(self) -> float:
        """Internal fragmentation: the share of allocated slots holding no token."""
        return 1.0 - self.tokens_stored / self.slots_allocated if self.slots_allocated else 0.0


@dataclass
class _RequestBlocks:
    table: BlockTable
    root: BlockHash  # the chain's start, from the request's cache salt
    # Chained keys of the request's first len(block_hashes) full blocks; each was offered to the
    # prefix cache when it filled, so only later blocks are hashed and registered.
    block_hashes: list[BlockHash]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        self._prefix_cache = PrefixCache(block_size)
        self._allocator = BlockAllocator(num_blocks, block_size, on_evict=self._prefix_cache.forget)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._requests: dict[str, _RequestBlocks] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus evictable cached."""
        return self._allocator.num_available

    def get_computed_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, verified against stored token ids, capped so at
        least one token remains to compute (its logits are needed to sample). Takes no references.
        Returns (block ids, number of tokens they hold)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        blocks = self._prefix_cache.lookup(token_ids, root_hash(cache_salt), max_blocks)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> list[int] | None:
        """Make the request's table cover num_computed_tokens + num_new_tokens positions and
        return it, or return None and change nothing when the blocks are not there.
        `new_computed_blocks` (from get_computed_blocks) count on the first call only."""
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got num_computed_tokens={num_computed_tokens}, num_new_tokens={num_new_tokens}")
        state = self._requests.get(request_id)
        if state is None or new_computed_blocks:
            return self._allocate_first(request_id, state, token_ids, num_computed_tokens, num_new_tokens,
                                        new_computed_blocks, cache_salt)
        # The per-step path (every running request, every step): the request holds blocks and
        # only grows. Kept free of anything a decode step does not need.
        table = state.table
        size = self.block_size
        end = num_computed_tokens + num_new_tokens
        first = num_computed_tokens // size
        # Steady decode, 15 steps in 16: the step writes into one block the request already
        # holds alone, so there is nothing to allocate or copy, only a fill count to advance
        # (and, when the block just filled, a prefix-cache entry to offer).
        if 0 < num_new_tokens and end <= (first + 1) * size and first < len(table):
            block_id = table[first]
            if not self._allocator.is_shared(block_id) and not self._prefix_cache.is_cached(block_id):
                self._allocator.fill_held(block_id, end - first * size)
                if end > table.num_tokens:
                    table.num_tokens = end
                if self.enable_prefix_caching:
                    num_full = min(len(token_ids), end) // size
                    if num_full > len(state.block_hashes):
                        self._register_full_blocks(state, token_ids, num_full)
                return table.block_ids
        num_blocks_needed = -(-end // size)
        num_held = len(table)
        # Copy-on-write: blocks this step writes into that another request also holds, or that
        # the prefix cache holds (its tokens are promised to future hits). Normally that is the
        # partial block a fork shares; a cached block is only written after a fork that ends
        # mid-block, once its other holders are gone. Usually one block is written: a decode's.
        allocator, cache = self._allocator, self._prefix_cache
        shared = []
        for index in range(first, min(num_held, num_blocks_needed)):
            block_id = table[index]
            if allocator.refcount(block_id) > 1 or cache.is_cached(block_id):
                shared.append(index)
        num_missing = num_blocks_needed - num_held
        if (num_missing > 0 or shared) and max(0, num_missing) + len(shared) > allocator.num_available:
            return None
        self._grow(state, token_ids, num_computed_tokens, end, shared, num_missing)
        return table.block_ids

    def _allocate_first(
        self,
        request_id: str,
        state: _RequestBlocks | None,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int],
        cache_salt: str | None,
    ) -> list[int] | None:
        """allocate_slots for a request holding no blocks yet, starting with its prefix hits."""
        size = self.block_size
        root = state.root if state is not None else root_hash(cache_salt)
        verified_hashes = self._check_computed_blocks(request_id, state, token_ids, num_computed_tokens, new_computed_blocks, root)

        # Plan everything first so that failing changes nothing.
        end = num_computed_tokens + num_new_tokens
        num_blocks_needed = -(-end // size)
        num_missing = num_blocks_needed - len(new_computed_blocks)
        num_revived = sum(1 for block_id in new_computed_blocks if self._allocator.is_cached_free(block_id))
        if max(0, num_missing) > self._allocator.num_available - num_revived:
            return None

        state = _RequestBlocks(BlockTable(size), root, verified_hashes)
        self._requests[request_id] = state
        for block_id in new_computed_blocks:
            self._allocator.incref(block_id)
            state.table.append_block(block_id)
        state.table.append_tokens(len(new_computed_blocks) * size)
        self._grow(state, token_ids, num_computed_tokens, end, [], num_missing)
        return state.table.block_ids

    def _grow(self, state: _RequestBlocks, token_ids: Sequence[int], num_computed_tokens: int, end: int,
              shared: list[int], num_missing: int) -> None:
        """Carries out a plan that fits: copies for shared blocks, new blocks, fill counts, and
        the prefix-cache registration of blocks that became full."""
        size = self.block_size
        allocator = self._allocator
        table = state.table
        for index in shared:
            copy = allocator.allocate()
            source = table.replace_block(index, copy)
            allocator.release(source, keep_cached=self._prefix_cache.is_cached(source))
            allocator.mark_filled(copy, min(size, max(0, num_computed_tokens - index * size)))
            self._blocks_to_copy.append((source, copy))
        for _ in range(num_missing):
            table.append_block(allocator.allocate())
        for index in range(num_computed_tokens // size, -(-end // size)):
            allocator.mark_filled(table[index], min(size, end - index * size))
        if end > table.num_tokens:
            table.append_tokens(end - table.num_tokens)
        num_full = min(len(token_ids), end) // size
        if self.enable_prefix_caching and num_full > len(state.block_hashes):
            self._register_full_blocks(state, token_ids, num_full)

    def _check_computed_blocks(
        self,
        request_id: str,
        state: _RequestBlocks | None,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        new_computed_blocks: Sequence[int],
        root: BlockHash,
    ) -> list[BlockHash]:
        """Reject prefix-hit blocks that cannot be right, before anything changes; return their keys."""
        if not new_computed_blocks:
            return []
        if state is not None:
            raise PagingError(
                f"request {request_id!r} already holds blocks: pass new_computed_blocks only on its first "
                "allocate_slots call (after free() it is a first call again)"
            )
        if len(new_computed_blocks) * self.block_size > num_computed_tokens:
            raise PagingError(
                f"{len(new_computed_blocks)} computed blocks hold {len(new_computed_blocks) * self.block_size} tokens "
                f"but num_computed_tokens is {num_computed_tokens}: pass the token count get_computed_blocks returned"
            )
        hashes: list[BlockHash] = []
        self._prefix_cache.extend_hashes(hashes, token_ids, root, len(new_computed_blocks))
        for block_id, expected in zip(new_computed_blocks, hashes):
            if not self._prefix_cache.is_cached(block_id) or self._prefix_cache.hash_of(block_id) != expected:
                raise PagingError(
                    f"block {block_id} no longer holds this request's prefix (evicted since get_computed_blocks): "
                    "call get_computed_blocks right before allocate_slots, with no allocation in between"
                )
        return hashes

    def _register_full_blocks(self, state: _RequestBlocks, token_ids: Sequence[int], num_full: int) -> None:
        """Offer blocks that became full since the last call to the prefix cache."""
        hashes = state.block_hashes
        first_new = len(hashes)
        self._prefix_cache.extend_hashes(hashes, token_ids, state.root, num_full)
        size = self.block_size
        for index in range(first_new, num_full):
            parent = hashes[index - 1] if index else state.root
            self._prefix_cache.register(state.table[index], hashes[index], parent, token_ids[index * size : (index + 1) * size])

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty for a request holding no blocks)."""
        state = self._requests.get(request_id)
        return state.table.block_ids if state is not None else []

    def free(self, request_id: str) -> None:
        """Release every block the request holds; a request holding none is a no-op."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        # Last block first: released blocks join the LRU in this order, so a finished request's
        # tail (the part least likely to be shared) is evicted before its prefix.
        for block_id in reversed(state.table.block_ids):
            self._allocator.release(block_id, keep_cached=self._prefix_cache.is_cached(block_id))
        if self._blocks_to_copy:
            self._blocks_to_copy = [(src, dst) for src, dst in self._blocks_to_copy if self._allocator.refcount(dst) > 0]

    def fork(self, parent_request_id: str, child_request_id: str, num_tokens: int) -> None:
        """The child shares (by reference) the parent's blocks covering its first num_tokens
        positions; whichever writes first into a shared partial block gets a copy."""
        parent = self._requests.get(parent_request_id)
        if parent is None:
            raise UnknownRequestError(parent_request_id, "fork")
        if child_request_id in self._requests:
            raise PagingError(f"cannot fork into {child_request_id!r}: it already holds blocks; free it first")
        if not 0 <= num_tokens <= parent.table.num_tokens:
            raise PagingError(f"cannot fork {num_tokens} tokens: {parent_request_id!r} holds {parent.table.num_tokens}")
        shared = parent.table.block_ids[: -(-num_tokens // self.block_size)]
        for block_id in shared:
            self._allocator.incref(block_id)
        self._requests[child_request_id] = _RequestBlocks(
            BlockTable(self.block_size, shared, num_tokens),
            parent.root,
            parent.block_hashes[: num_tokens // self.block_size],
        )

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The queued (source, destination) copy-on-write pairs, emptying the queue."""
        pairs, self._blocks_to_copy = self._blocks_to_copy, []
        return pairs

    def stats(self) -> KVCacheStats:
        allocator = self._allocator
        return KVCacheStats(
            blocks_total=self.num_blocks,
            blocks_used=allocator.num_used,
            blocks_cached=allocator.num_cached,
            blocks_free=allocator.num_free,
            tokens_stored=allocator.tokens_in_used_blocks,
            slots_allocated=allocator.num_used * self.block_size,
            prefix_cache_queries=self._prefix_cache.queries,
            prefix_cache_hits=self._prefix_cache.hits,
        )

    # Read-only views for tests and debugging tools.
    def refcount(self, block_id: int) -> int:
        return self._allocator.refcount(block_id)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a prefix-cache entry (in use or evictable)."""
        return self._prefix_cache.is_cached(block_id)

    def eviction_order(self) -> list[int]:
        """Cached-free blocks, the next to be evicted first."""
        return self._allocator.cached_lru_order()

    def request_ids(self) -> list[str]:
        return list(self._requests)
