"""A model with two layer groups: one block table per group, blocks from one shared pool."""

import pytest

from kvserve.paging import NO_NEW_BLOCKS, FullAttentionSpec, KVCacheManager, KVCacheTooSmallError

A = FullAttentionSpec(2, 16, "float32", 4)
B = FullAttentionSpec(1, 32, "float32", 4)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def two_groups(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, 16, group_specs=[A, B])


def admit(manager: KVCacheManager, request_id: str, prompt: list[int]):
    blocks, num_cached = manager.get_computed_blocks(prompt)
    return manager.allocate_slots(request_id, prompt, num_cached, len(prompt) - num_cached, blocks)


def test_each_group_gets_its_own_blocks_from_the_shared_pool_in_order():
    manager = two_groups(12)
    assert admit(manager, "a", tokens(40)) == ((0, 1, 2), (3, 4, 5))
    assert admit(manager, "b", tokens(17, start=500)) == ((6, 7), (8, 9))
    a = tokens(40)
    for position in range(40, 48):
        a.append(position)
        assert manager.allocate_slots("a", a, position, 1) is NO_NEW_BLOCKS
    a.append(48)
    assert manager.allocate_slots("a", a, 48, 1) == ((10,), (11,))
    assert manager.block_tables("a") == ((0, 1, 2, 10), (3, 4, 5, 11))
    assert manager.stats().blocks_used == 12
    manager.free("a")
    manager.free("b")
    stats = manager.stats()
    assert stats.blocks_used == 0 and stats.blocks_cached + stats.blocks_free == 12


def test_a_prefix_hit_needs_the_block_in_every_group():
    manager = two_groups(13)
    admit(manager, "a", tokens(40))
    assert manager.get_computed_blocks(tokens(40)) == (((0, 1), (3, 4)), 32)
    manager.free("a")  # group A's table last-first, then B's: the LRU is 1, 0, 4, 3; 2 and 5 are free
    assert manager.eviction_order() == [1, 0, 4, 3]
    # Free blocks go out lowest id first, A's freed 2 and 5 before the never-used ones.
    assert admit(manager, "b", tokens(20, start=900)) == ((2, 5), (6, 7))
    assert admit(manager, "c", tokens(20, start=700)) == ((8, 9), (10, 11))
    assert admit(manager, "d", tokens(16, start=300)) == ((12,), (1,))  # 12 was free; 1 is evicted from A's cache
    # Group A now holds one block of the prefix, group B two: a request can reuse one.
    assert manager.get_computed_blocks(tokens(40)) == (((0,), (3,)), 16)
    assert admit(manager, "e", tokens(40)) is None  # two more blocks in each group; only block 4 is evictable
    manager.free("b")  # b's full blocks 2 and 6 cached, its partial 5 and 7 free
    assert admit(manager, "e", tokens(40)) == ((0, 5, 7), (3, 4, 2))  # the free two, then the LRU's 4 and 2
    assert manager.refcount(0) == manager.refcount(3) == 1

def test_copy_on_write_copies_in_every_group_and_reports_the_rewritten_tables():
    manager = two_groups(8)
    admit(manager, "parent", tokens(15))
    manager.fork("parent", "child", 15)
    assert manager.block_tables("child") == ((0,), (1,))
    assert manager.allocate_slots("child", tokens(15) + [7], 15, 1) is NO_NEW_BLOCKS  # copies, appends nothing
    assert manager.block_tables("child") == ((2,), (3,))
    assert manager.take_blocks_to_copy() == [(0, 2), (1, 3)]
    assert manager.take_rewritten_request_ids() == {"child"}
    assert manager.take_rewritten_request_ids() == set()
    assert manager.allocate_slots("parent", tokens(16), 15, 1) is NO_NEW_BLOCKS  # holds its blocks alone now
    assert manager.take_blocks_to_copy() == [] and manager.take_rewritten_request_ids() == set()


def test_failure_in_one_group_changes_no_group():
    manager = two_groups(5)
    admit(manager, "a", tokens(32))  # 2 blocks in each group
    before = (manager.stats(), manager.block_tables("a"))
    assert manager.allocate_slots("a", tokens(33), 32, 1) is None  # needs one block per group, one is free
    assert (manager.stats(), manager.block_tables("a")) == before


def test_the_longest_request_must_fit_in_both_tables():
    manager = two_groups(10)
    manager.check_max_model_len_fits(80)
    with pytest.raises(KVCacheTooSmallError, match="--max-model-len 80"):
        manager.check_max_model_len_fits(81)


def test_prefix_hits_must_come_for_every_group():
    manager = two_groups(8)
    admit(manager, "a", tokens(40))
    with pytest.raises(Exception, match="as many blocks for each of the 2 layer groups"):
        manager.allocate_slots("b", tokens(40), 16, 24, ((0,), ()))
