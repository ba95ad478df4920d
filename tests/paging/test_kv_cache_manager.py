"""Exact block ids, eviction order and copy-on-write at the 15/16/17-token boundaries."""

import pytest

from kvserve.paging import KVCacheManager, PagingError, UnknownRequestError


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def admit(manager: KVCacheManager, request_id: str, prompt: list[int], salt: str | None = None) -> list[int] | None:
    """What the scheduler does for a new request: prefix lookup, then the whole prompt. Returns
    the block table (a first allocation returns the whole table), or None."""
    blocks, num_cached = manager.get_computed_blocks(prompt, salt)
    new = manager.allocate_slots(request_id, prompt, num_cached, len(prompt) - num_cached, blocks, salt)
    if new is None:
        return None
    assert new == (tuple(manager.block_ids(request_id)),)
    return manager.block_ids(request_id)


def grow(manager: KVCacheManager, request_id: str, token_ids: list[int], num_computed: int, num_new: int,
         hit: list[int] = (), salt: str | None = None) -> list[int] | None:
    """allocate_slots on a one-group manager: the table afterwards (None on failure), after
    checking that the call reported exactly the blocks it appended."""
    before = manager.block_ids(request_id)
    new = manager.allocate_slots(request_id, token_ids, num_computed, num_new, (tuple(hit),) if hit else (), salt)
    if new is None:
        return None
    after = manager.block_ids(request_id)
    appended = after if not before else after[len(before):]
    assert new == ((tuple(appended),) if appended else ())
    return after


def hit(manager: KVCacheManager, token_ids: list[int], salt: str | None = None) -> tuple[list[int], int]:
    """get_computed_blocks on a one-group manager."""
    (blocks,), num_cached = manager.get_computed_blocks(token_ids, salt)
    return list(blocks), num_cached


def test_exact_block_ids_as_requests_grow():
    manager = KVCacheManager(8, 16)
    a, b = tokens(40), tokens(17, start=1000)
    assert admit(manager, "a", a) == [0, 1, 2]
    assert admit(manager, "b", b) == [3, 4]
    for position in range(40, 48):  # decode: block 2 has room up to position 47
        a.append(position)
        assert grow(manager, "a", a, position, 1) == [0, 1, 2]
    a.append(48)
    assert grow(manager, "a", a, 48, 1) == [0, 1, 2, 5]
    assert manager.block_ids("b") == [3, 4]


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    manager = KVCacheManager(8, 16)
    admit(manager, "a", tokens(40))
    assert hit(manager, tokens(40)) == ([0, 1], 32)
    assert hit(manager, tokens(32)) == ([0], 16)  # the last token must be computed
    assert hit(manager, tokens(33)) == ([0, 1], 32)
    assert admit(manager, "b", tokens(33)) == [0, 1, 3]
    assert (manager.refcount(0), manager.refcount(1), manager.refcount(2)) == (2, 2, 1)
    stats = manager.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40 + 40 + 32 + 33 + 33, 32 + 16 + 32 + 32)


def test_a_block_registered_this_step_is_hit_by_the_next_request_in_the_same_step():
    manager = KVCacheManager(8, 16)
    admit(manager, "a", tokens(20))
    assert admit(manager, "b", tokens(20)) == [0, 2]


def test_eviction_order_last_blocks_of_a_finished_request_first_then_older_requests():
    manager = KVCacheManager(6, 16)
    a = tokens(48)
    assert admit(manager, "a", a) == [0, 1, 2]
    assert admit(manager, "b", tokens(20, start=500)) == [3, 4]
    manager.free("a")
    assert manager.eviction_order() == [2, 1, 0]
    manager.free("b")
    assert manager.eviction_order() == [2, 1, 0, 3]  # b's partial block 4 went to the free list
    stats = manager.stats()
    assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free, manager.num_free_blocks) == (0, 4, 2, 6)
    # Free blocks first (lowest id first: 4, then 5), then the LRU: a's tail before its head.
    assert admit(manager, "c", tokens(64, start=900)) == [4, 5, 2, 1]
    assert manager.eviction_order() == [0, 3]
    assert hit(manager, a) == ([0], 16)  # block 1 was evicted: the chain stops


def test_a_prefix_hit_takes_blocks_out_of_the_lru_and_free_puts_them_back_last():
    manager = KVCacheManager(6, 16)
    admit(manager, "a", tokens(48))
    manager.free("a")
    assert admit(manager, "b", tokens(40)) == [0, 1, 3]
    assert manager.eviction_order() == [2]
    manager.free("b")
    assert manager.eviction_order() == [2, 1, 0]


@pytest.mark.parametrize(
    ("fork_at", "parent_blocks", "child_after_write", "copies"),
    [
        (15, [0], [1], [(0, 1)]),  # partial shared block: copied before the child writes row 15
        (16, [0], [0, 1], []),  # full shared block: the child's token starts a fresh block
        (17, [0, 1], [0, 2], [(1, 2)]),  # row 0 of block 1 is shared: copied
    ],
)
def test_copy_on_write_at_block_boundaries(fork_at, parent_blocks, child_after_write, copies):
    manager = KVCacheManager(8, 16)
    prompt = tokens(fork_at)
    assert admit(manager, "parent", prompt) == parent_blocks
    manager.fork("parent", "child", fork_at)
    assert manager.block_ids("child") == parent_blocks
    assert grow(manager, "child", prompt + [7], fork_at, 1) == child_after_write
    assert manager.take_blocks_to_copy() == copies
    assert manager.take_blocks_to_copy() == []  # drained
    # The parent now holds its blocks alone: it writes in place, no copy.
    assert grow(manager, "parent", prompt + [8], fork_at, 1) == parent_blocks + ([2] if fork_at == 16 else [])
    assert manager.take_blocks_to_copy() == []
    for block_id in set(parent_blocks) | set(child_after_write):
        expected = int(block_id in parent_blocks) + int(block_id in child_after_write)
        assert manager.refcount(block_id) == expected


def test_the_first_writer_of_a_shared_block_gets_the_copy_either_way():
    manager = KVCacheManager(8, 16)
    admit(manager, "parent", tokens(15))
    manager.fork("parent", "child", 15)
    assert grow(manager, "parent", tokens(16), 15, 1) == [1]
    assert manager.take_blocks_to_copy() == [(0, 1)]
    assert manager.block_ids("child") == [0]


def test_forked_copies_with_equal_tokens_share_one_cached_block():
    manager = KVCacheManager(8, 16)
    admit(manager, "parent", tokens(15))
    manager.fork("parent", "child", 15)
    grow(manager, "child", tokens(16), 15, 1)  # child's copy is block 1, now full
    grow(manager, "parent", tokens(16), 15, 1)  # same content in block 0: not a second entry
    assert hit(manager, tokens(17)) == ([1], 16)


def test_a_cached_block_is_copied_before_it_is_overwritten_even_when_held_alone():
    manager = KVCacheManager(8, 16)
    admit(manager, "parent", tokens(16))  # block 0 is full and cached
    manager.fork("parent", "child", 10)
    manager.free("parent")
    assert manager.refcount(0) == 1
    child = tokens(10) + [99]  # position 10 differs from what block 0 caches
    assert grow(manager, "child", child, 10, 1) == [1]
    assert manager.take_blocks_to_copy() == [(0, 1)]
    assert manager.eviction_order() == [0]  # still cached, now evictable
    assert hit(manager, tokens(17)) == ([0], 16)


def test_failure_changes_nothing():
    manager = KVCacheManager(4, 16)
    admit(manager, "a", tokens(48))
    manager.free("a")
    admit(manager, "b", tokens(20, start=100))  # takes free block 3 and evicts block 2
    blocks, num_cached = hit(manager, tokens(40))
    assert (blocks, num_cached) == ([0, 1], 32)
    before = (manager.stats(), manager.eviction_order(), manager.request_ids())
    # The two hits are the last available blocks: no third block for tokens 32..39.
    assert grow(manager, "c", tokens(40), num_cached, 8, blocks) is None
    assert (manager.stats(), manager.eviction_order(), manager.request_ids()) == before
    assert manager.block_ids("c") == []
    manager.free("b")
    assert grow(manager, "c", tokens(40), num_cached, 8, blocks) == [0, 1, 2]


def test_copy_on_write_that_does_not_fit_changes_nothing():
    manager = KVCacheManager(2, 16)
    admit(manager, "parent", tokens(20))
    manager.fork("parent", "child", 20)
    assert grow(manager, "child", tokens(21), 20, 1) is None
    assert manager.block_ids("child") == [0, 1] and manager.take_blocks_to_copy() == []
    assert (manager.refcount(0), manager.refcount(1)) == (2, 2)


def test_free_releases_everything_and_unknown_requests_are_a_no_op():
    manager = KVCacheManager(4, 16, enable_prefix_caching=False)
    admit(manager, "a", tokens(33))
    manager.free("a")
    manager.free("a")
    manager.free("never-seen")
    stats = manager.stats()
    assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (0, 0, 4)
    assert manager.block_ids("a") == []


def test_free_drops_pending_copies_into_its_own_blocks():
    manager = KVCacheManager(8, 16)
    admit(manager, "parent", tokens(15))
    manager.fork("parent", "child", 15)
    grow(manager, "child", tokens(16), 15, 1)
    manager.free("child")
    assert manager.take_blocks_to_copy() == []


def test_prefix_caching_disabled_never_hits_and_never_caches():
    manager = KVCacheManager(4, 16, enable_prefix_caching=False)
    admit(manager, "a", tokens(40))
    manager.free("a")
    assert hit(manager, tokens(40)) == ([], 0)
    stats = manager.stats()
    assert (stats.blocks_cached, stats.blocks_free, stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 4, 0, 0)


def test_cache_salt_separates_tenants():
    manager = KVCacheManager(8, 16)
    admit(manager, "a", tokens(40), salt="tenant-a")
    assert hit(manager, tokens(40), "tenant-b") == ([], 0)
    assert hit(manager, tokens(40)) == ([], 0)
    assert hit(manager, tokens(40), "tenant-a") == ([0, 1], 32)


def test_forked_child_keeps_the_parents_salt():
    manager = KVCacheManager(8, 16)
    admit(manager, "p", tokens(20), salt="s")
    manager.fork("p", "c", 20)
    grow(manager, "c", tokens(32), 20, 12)
    assert hit(manager, tokens(33), "s") == ([0, 2], 32)


def test_stats_count_blocks_and_internal_fragmentation():
    manager = KVCacheManager(10, 16)
    admit(manager, "a", tokens(17))
    admit(manager, "b", tokens(32, start=100))
    stats = manager.stats()
    assert (stats.blocks_total, stats.blocks_used, stats.blocks_free) == (10, 4, 6)
    assert (stats.tokens_stored, stats.slots_allocated) == (49, 64)
    assert stats.fragmentation == pytest.approx(15 / 64)
    assert stats.usage == pytest.approx(0.4)


def test_shared_blocks_count_once_in_the_stats():
    manager = KVCacheManager(10, 16)
    admit(manager, "p", tokens(20))
    manager.fork("p", "c", 20)
    stats = manager.stats()
    assert (stats.blocks_used, stats.tokens_stored, stats.slots_allocated) == (2, 20, 32)


def test_misuse_raises_clear_errors():
    manager = KVCacheManager(8, 16)
    admit(manager, "a", tokens(40))
    with pytest.raises(UnknownRequestError, match="holds no KV blocks"):
        manager.fork("nobody", "x", 1)
    with pytest.raises(PagingError, match="already holds blocks"):
        manager.fork("a", "a", 1)
    with pytest.raises(PagingError, match="cannot fork 41 tokens"):
        manager.fork("a", "b", 41)
    with pytest.raises(PagingError, match="first allocate_slots call"):
        grow(manager, "a", tokens(41), 40, 1, [0])
    with pytest.raises(PagingError, match="num_computed_tokens is 0"):
        grow(manager, "b", tokens(40), 0, 40, [0])
    with pytest.raises(ValueError, match=">= 0"):
        grow(manager, "b", tokens(40), -1, 40)


def test_stale_prefix_hits_are_refused():
    manager = KVCacheManager(3, 16)
    admit(manager, "a", tokens(20))
    manager.free("a")
    blocks, num_cached = hit(manager, tokens(20))
    assert blocks == [0]
    admit(manager, "b", tokens(48, start=100))  # evicts block 0 and refills it with other tokens
    with pytest.raises(PagingError, match="evicted since get_computed_blocks"):
        grow(manager, "c", tokens(20), num_cached, 4, blocks)
    assert manager.block_ids("c") == []


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_waste_is_at_most_block_size_minus_one_per_sequence(block_size):
    manager = KVCacheManager(1000, block_size, enable_prefix_caching=False)
    lengths = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size - 1, 100, 257]
    for index, length in enumerate(lengths):
        admit(manager, f"r{index}", tokens(length, start=10_000 * index))
    for index, length in enumerate(lengths):
        assert len(manager.block_ids(f"r{index}")) * block_size - length <= block_size - 1
    stats = manager.stats()
    assert stats.slots_allocated - stats.tokens_stored <= (block_size - 1) * len(lengths)
    assert stats.tokens_stored == sum(lengths)
