"""The one facade the scheduler uses: block tables per request over a shared, prefix-cached pool.

Per step, for each request it runs, the scheduler calls

    blocks, num_cached = manager.get_computed_blocks(tokens, salt)     # first time only
    new_blocks = manager.allocate_slots(request_id, tokens, num_computed, num_new, blocks, salt)
    if new_blocks is None: preempt someone (manager.free(victim)) and retry, or wait

and after schedule() it drains `take_blocks_to_copy()` into the SchedulerOutput so the runner
copies copy-on-write blocks before the forward pass.

A model whose layers keep different caches has several layer groups (paging/kv_cache_spec.py):
the request keeps one block table per group, every group draws from one allocator, and each
group's kind of layer has its own small manager (paging/single_type_manager.py). Block ids go
per group, in group order: `get_computed_blocks` and `allocate_slots` speak tuples with one
entry per group. A sliding-window group's tables (and its prefix hits) hold None for the blocks
that lie wholly outside its window: given back to the pool, or never needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.paging.block_allocator import BlockAllocator
from kvserve.paging.block_table import BlockTable
from kvserve.paging.errors import PagingError, UnknownRequestError
from kvserve.paging.kv_cache_spec import (
    FullAttentionSpec, KVCacheConfig, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec, check_max_model_len_fits,
)
from kvserve.paging.prefix_cache import BlockHash, root_hash
from kvserve.paging.single_type_manager import FullAttentionManager, SlidingWindowManager

# Per group: block ids (new ones appended to a table, a whole table, or a prefix hit's); None in
# a window group's table or hit: a block outside its window (paging/block_table.py).
GroupBlockIds = tuple[tuple[int | None, ...], ...]
# allocate_slots' answer when no table gained a block (15 decode steps in 16).
NO_NEW_BLOCKS: GroupBlockIds = ()
# A latent (MLA) layer reads every earlier token's latent, as full attention reads its K/V.
MANAGER_OF_KIND: dict[type, type[FullAttentionManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


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
    tables: list[BlockTable]  # one per layer group
    root: BlockHash  # the chain's start, from the request's cache salt
    # Chained keys of the request's first len(block_hashes) full blocks; each was offered to the
    # prefix cache (of every group) when it filled, so only later blocks are hashed and registered.
    block_hashes: list[BlockHash]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 group_specs: Sequence[KVCacheSpec] | None = None) -> None:
        """`group_specs`: one spec per layer group (KVCacheConfig.groups); None is one group of
        full-attention layers, all the bookkeeping a plain decoder needs."""
        self._allocator = BlockAllocator(num_blocks, block_size, on_evict=self._forget_evicted)
        specs = list(group_specs) if group_specs is not None else [FullAttentionSpec(1, 1, "any", 1)]
        self._group_specs = specs
        self._groups = [MANAGER_OF_KIND[type(spec)].from_spec(spec, self._allocator, block_size) for spec in specs]
        # The groups that give blocks back while a request runs (sliding windows): every
        # allocate_slots call lets them, before it plans.
        self._giving_back = [index for index, group in enumerate(self._groups) if group.gives_back_blocks]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._requests: dict[str, _RequestBlocks] = {}
        self._rewritten: set[str] = set()
        self.prefix_cache_queries = 0  # cumulative, tokens looked up
        self.prefix_cache_hits = 0  # cumulative, tokens found (in every group)

    @classmethod
    def from_config(cls, config: KVCacheConfig, enable_prefix_caching: bool = True) -> "KVCacheManager":
        return cls(config.num_blocks, config.block_size, enable_prefix_caching, [g.spec for g in config.groups])

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus evictable cached."""
        return self._allocator.num_available

    def check_max_model_len_fits(self, max_model_len: int, max_step_tokens: int | None = None) -> None:
        """Raises KVCacheTooSmallError when one request of max_model_len tokens could not hold
        its blocks in every group at once, in steps of at most `max_step_tokens` tokens."""
        check_max_model_len_fits(self._group_specs, max_model_len, self.num_blocks, self.block_size, max_step_tokens)

    def get_computed_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[GroupBlockIds, int]:
        """Longest cached prefix of full blocks that every group can serve, verified against
        stored token ids, capped so at least one token remains to compute (its logits are needed
        to sample). Takes no references. Returns (block ids per group, number of tokens they
        hold); a window group's hit holds None for the blocks before its window."""
        if not self.enable_prefix_caching:
            return tuple(() for _ in self._groups), 0
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        root, hashes = root_hash(cache_salt), []
        while True:
            # Each group looks no further than the ones before it found. A full-attention hit
            # stays valid when cut shorter, a window hit does not (it needs the blocks right
            # before its end): when a later group finds less, the others look again from there.
            hits: list[list[int | None]] = []
            for group in self._groups:
                hits.append(group.find_longest_cache_hit(token_ids, hashes, root, max_blocks))
                max_blocks = min(max_blocks, len(hits[-1]))
            if all(len(blocks) == max_blocks for blocks in hits):
                break
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += max_blocks * self.block_size
        return tuple(tuple(blocks[:max_blocks]) for blocks in hits), max_blocks * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: GroupBlockIds = (),
        cache_salt: str | None = None,
    ) -> GroupBlockIds | None:
        """Make the request's tables cover num_computed_tokens + num_new_tokens positions and
        return the block ids this call appended (per group; NO_NEW_BLOCKS when none), or return
        None and change nothing when the blocks are not there. A first call returns the whole
        tables, prefix hits included. `new_computed_blocks` (from get_computed_blocks) count on
        the first call only. A table rewritten by copy-on-write is reported by
        `take_rewritten_request_ids` instead."""
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got num_computed_tokens={num_computed_tokens}, num_new_tokens={num_new_tokens}")
        state = self._requests.get(request_id)
        if state is None or any(new_computed_blocks):
            return self._allocate_first(request_id, state, token_ids, num_computed_tokens, num_new_tokens,
                                        new_computed_blocks, cache_salt)
        # The per-step path (every running request, every step): the request holds blocks and
        # only grows. Kept free of anything a decode step does not need.
        for index in self._giving_back:  # blocks no query from num_computed_tokens on reads
            self._groups[index].remove_skipped_blocks(state.tables[index], num_computed_tokens)
        size = self.block_size
        end = num_computed_tokens + num_new_tokens
        first = num_computed_tokens // size
        # Steady decode, 15 steps in 16: the step writes into one block each table already holds
        # alone, so there is nothing to allocate or copy, only fill counts to advance (and, when
        # the block just filled, prefix-cache entries to offer).
        if 0 < num_new_tokens and end <= (first + 1) * size and self._writes_in_place(state.tables, first):
            fill = end - first * size
            for table in state.tables:
                self._allocator.fill_held(table[first], fill)
                if end > table.num_tokens:
                    table.num_tokens = end
            if self.enable_prefix_caching:
                num_full = min(len(token_ids), end) // size
                if num_full > len(state.block_hashes):
                    self._register_full_blocks(state, token_ids, num_full)
            return NO_NEW_BLOCKS
        plans = [group.plan_growth(table, num_computed_tokens, end) for group, table in zip(self._groups, state.tables)]
        needed = sum(plan.num_blocks for plan in plans)
        if needed and needed > self._allocator.num_available:
            return None
        return self._grow(request_id, state, token_ids, num_computed_tokens, end, plans)

    def _writes_in_place(self, tables: list[BlockTable], first: int) -> bool:
        """Whether logical block `first` exists in every table and is held by it alone, uncached."""
        allocator = self._allocator
        for group, table in zip(self._groups, tables):
            if first >= len(table):
                return False
            block_id = table[first]
            if allocator.is_shared(block_id) or group.prefix_cache.is_cached(block_id):
                return False
        return True

    def _allocate_first(
        self,
        request_id: str,
        state: _RequestBlocks | None,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: GroupBlockIds,
        cache_salt: str | None,
    ) -> GroupBlockIds | None:
        """allocate_slots for a request holding no blocks yet, starting with its prefix hits."""
        size = self.block_size
        root = state.root if state is not None else root_hash(cache_salt)
        hits = tuple(new_computed_blocks) or tuple(() for _ in self._groups)
        verified_hashes = self._check_computed_blocks(request_id, state, token_ids, num_computed_tokens, hits, root)

        # Plan everything first so that failing changes nothing.
        end = num_computed_tokens + num_new_tokens
        num_hit = len(hits[0])
        num_missing = len(self._groups) * max(0, -(-end // size) - num_hit)
        num_revived = sum(1 for blocks in hits for block_id in blocks
                          if block_id is not None and self._allocator.is_cached_free(block_id))
        if num_missing > self._allocator.num_available - num_revived:
            return None

        state = _RequestBlocks([BlockTable(size) for _ in self._groups], root, verified_hashes)
        self._requests[request_id] = state
        for table, blocks in zip(state.tables, hits):
            for block_id in blocks:
                if block_id is not None:
                    self._allocator.incref(block_id)
                table.append_block(block_id)
            table.append_tokens(num_hit * size)
        plans = [group.plan_growth(table, num_computed_tokens, end) for group, table in zip(self._groups, state.tables)]
        self._grow(request_id, state, token_ids, num_computed_tokens, end, plans)
        return tuple(tuple(table.block_ids) for table in state.tables)

    def _grow(self, request_id: str, state: _RequestBlocks, token_ids: Sequence[int], num_computed_tokens: int,
              end: int, plans: list) -> GroupBlockIds:
        """Carries out plans that fit (one per group), then registers the blocks that became full."""
        appended = tuple(tuple(group.grow(table, plan, num_computed_tokens, end))
                         for group, table, plan in zip(self._groups, state.tables, plans))
        if any(plan.shared for plan in plans):
            self._rewritten.add(request_id)
        num_full = min(len(token_ids), end) // self.block_size
        if self.enable_prefix_caching and num_full > len(state.block_hashes):
            self._register_full_blocks(state, token_ids, num_full)
        return appended if any(appended) else NO_NEW_BLOCKS

    def _check_computed_blocks(
        self,
        request_id: str,
        state: _RequestBlocks | None,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        new_computed_blocks: GroupBlockIds,
        root: BlockHash,
    ) -> list[BlockHash]:
        """Reject prefix-hit blocks that cannot be right, before anything changes; return their keys."""
        num_hit = len(new_computed_blocks[0])
        if not num_hit:
            return []
        if state is not None:
            raise PagingError(
                f"request {request_id!r} already holds blocks: pass new_computed_blocks only on its first "
                "allocate_slots call (after free() it is a first call again)"
            )
        if len(new_computed_blocks) != len(self._groups) or any(len(b) != num_hit for b in new_computed_blocks):
            raise PagingError(f"new_computed_blocks must hold as many blocks for each of the {len(self._groups)} "
                              f"layer groups (as get_computed_blocks returns them), got {new_computed_blocks}")
        if num_hit * self.block_size > num_computed_tokens:
            raise PagingError(
                f"{num_hit} computed blocks hold {num_hit * self.block_size} tokens "
                f"but num_computed_tokens is {num_computed_tokens}: pass the token count get_computed_blocks returned"
            )
        hashes: list[BlockHash] = []
        self._groups[0].prefix_cache.extend_hashes(hashes, token_ids, root, num_hit)
        for group, blocks in zip(self._groups, new_computed_blocks):
            for block_id, expected in zip(blocks, hashes):
                if block_id is None:  # a block the group does not need (before a window)
                    continue
                if not group.prefix_cache.is_cached(block_id) or group.prefix_cache.hash_of(block_id) != expected:
                    raise PagingError(
                        f"block {block_id} no longer holds this request's prefix (evicted since get_computed_blocks): "
                        "call get_computed_blocks right before allocate_slots, with no allocation in between"
                    )
        return hashes

    def _register_full_blocks(self, state: _RequestBlocks, token_ids: Sequence[int], num_full: int) -> None:
        """Offer blocks that became full since the last call to every group's prefix cache."""
        hashes = state.block_hashes
        first_new = len(hashes)
        self._groups[0].prefix_cache.extend_hashes(hashes, token_ids, state.root, num_full)
        for group, table in zip(self._groups, state.tables):
            group.register_full_blocks(table, hashes, state.root, token_ids, first_new, num_full)

    def _forget_evicted(self, block_id: int) -> None:
        for group in self._groups:
            if group.prefix_cache.is_cached(block_id):
                group.prefix_cache.forget(block_id)
                return

    def block_ids(self, request_id: str, group: int = 0) -> list[int | None]:
        """One of the request's block tables (empty for a request holding no blocks)."""
        state = self._requests.get(request_id)
        return state.tables[group].block_ids if state is not None else []

    def block_tables(self, request_id: str) -> GroupBlockIds:
        """All of the request's block tables, in group order."""
        state = self._requests.get(request_id)
        if state is None:
            return tuple(() for _ in self._groups)
        return tuple(tuple(table.block_ids) for table in state.tables)

    def free(self, request_id: str) -> None:
        """Release every block the request holds; a request holding none is a no-op."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._rewritten.discard(request_id)
        for group, table in zip(self._groups, state.tables):
            group.free(table)

    def fork(self, parent_request_id: str, child_request_id: str, num_tokens: int) -> None:
        """The child shares (by reference) the parent's blocks covering its first num_tokens
        positions; whichever writes first into a shared partial block gets a copy."""
        parent = self._requests.get(parent_request_id)
        if parent is None:
            raise UnknownRequestError(parent_request_id, "fork")
        if child_request_id in self._requests:
            raise PagingError(f"cannot fork into {child_request_id!r}: it already holds blocks; free it first")
        if not 0 <= num_tokens <= parent.tables[0].num_tokens:
            raise PagingError(f"cannot fork {num_tokens} tokens: {parent_request_id!r} holds {parent.tables[0].num_tokens}")
        self._requests[child_request_id] = _RequestBlocks(
            [group.fork(table, num_tokens) for group, table in zip(self._groups, parent.tables)],
            parent.root,
            parent.block_hashes[: num_tokens // self.block_size],
        )

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The queued (source, destination) copy-on-write pairs, emptying the queue."""
        pairs = []
        for group in self._groups:
            if group.blocks_to_copy:
                pairs += group.blocks_to_copy
                group.blocks_to_copy = []
        return pairs

    def take_rewritten_request_ids(self) -> set[str]:
        """Requests whose tables changed other than by appending (copy-on-write replaced a
        block) since the last call: whoever mirrors their tables must take them whole."""
        rewritten, self._rewritten = self._rewritten, set()
        return rewritten

    def stats(self) -> KVCacheStats:
        allocator = self._allocator
        return KVCacheStats(
            blocks_total=self.num_blocks,
            blocks_used=allocator.num_used,
            blocks_cached=allocator.num_cached,
            blocks_free=allocator.num_free,
            tokens_stored=allocator.tokens_in_used_blocks,
            slots_allocated=allocator.num_used * self.block_size,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    # Read-only views for tests and debugging tools.
    def refcount(self, block_id: int) -> int:
        return self._allocator.refcount(block_id)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a prefix-cache entry (in use or evictable)."""
        return any(group.prefix_cache.is_cached(block_id) for group in self._groups)

    def eviction_order(self) -> list[int]:
        """Cached-free blocks, the next to be evicted first."""
        return self._allocator.cached_lru_order()

    def request_ids(self) -> list[str]:
        return list(self._requests)
