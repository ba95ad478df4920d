"""Sliding-window layer groups: blocks that leave the window go back to the pool while the request
runs (None keeps the table's positions), prefix hits need only the window's blocks, and the sizing
counts a window group by what it holds at once. Exact block ids, as the full-attention tests."""

import math

import pytest

from kvserve.paging import (
    NO_NEW_BLOCKS, FullAttentionSpec, KVCacheConfig, KVCacheManager, KVCacheTooSmallError, PagingError,
    SlidingWindowSpec, group_layers, plan_kv_cache_config,
)
from kvserve.paging.kv_cache_spec import blocks_per_request, check_max_model_len_fits

FULL = FullAttentionSpec(2, 16, "float32", 4)
W32 = SlidingWindowSpec(2, 16, "float32", 4, sliding_window=32)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def admit(manager: KVCacheManager, request_id: str, prompt: list[int], num_new: int | None = None):
    blocks, num_cached = manager.get_computed_blocks(prompt)
    num_new = len(prompt) - num_cached if num_new is None else num_new
    return manager.allocate_slots(request_id, prompt, num_cached, num_new, blocks)


def decode_to(manager: KVCacheManager, request_id: str, history: list[int], length: int) -> None:
    """Decode steps (one token each) until the request holds `length` tokens."""
    while len(history) < length:
        position = len(history)
        history.append(position % 1000)
        assert manager.allocate_slots(request_id, history, position, 1) is not None


def held(manager: KVCacheManager, request_id: str, group: int = 0) -> int:
    return sum(block is not None for block in manager.block_ids(request_id, group))


# ------------------------------------------------------------------------------------ the spec


def test_a_window_spec_is_its_own_kind_with_the_full_spec_fields():
    assert W32 != FULL and W32.bytes_per_token == FULL.bytes_per_token and W32.page_bytes(16) == FULL.page_bytes(16)
    assert (W32.kind, FULL.kind) == ("sliding window", "full attention")
    assert group_layers([FULL, W32, FULL, W32]) == group_layers([FULL, W32, FULL, W32])
    assert [g.spec for g in group_layers([FULL, W32, FULL, W32])] == [FULL, W32]
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        SlidingWindowSpec(2, 16, "float32", 4, sliding_window=0)


@pytest.mark.parametrize("window", [1, 16, 17, 32, 33, 40, 1024, 4096])
def test_a_window_group_holds_at_most_a_window_and_a_step(window):
    spec = SlidingWindowSpec(1, 16, "float32", 4, sliding_window=window)
    # A decode reads positions p - w + 1 .. p: at most ceil((w - 1) / 16) + 1 blocks.
    assert spec.max_num_blocks(100_000, 16, 1) == math.ceil((window - 1) / 16) + 1
    # Brute force: the most blocks any span of w + n - 1 positions touches, for steps of n tokens.
    for step in (1, 5, 16, 48):
        worst = max((start + window + step - 2) // 16 - start // 16 + 1 for start in range(16))
        assert spec.max_num_blocks(100_000, 16, step) == worst
    assert spec.max_num_blocks(20, 16, 1) == min(2, math.ceil((window - 1) / 16) + 1)  # never more than its own
    assert spec.max_num_blocks(100_000, 16) == math.ceil(100_000 / 16)  # one step of everything


def test_sizing_counts_window_groups_by_their_cap():
    specs = [FULL] * 2 + [W32] * 2
    groups = group_layers(specs)
    # 1,000 tokens: 63 blocks in the full group, 3 in the window group (decodes), 5 with 32-token steps.
    assert blocks_per_request([g.spec for g in groups], 1000, 16, 1) == 63 + 3
    assert blocks_per_request([g.spec for g in groups], 1000, 16, 32) == 63 + 5
    check_max_model_len_fits([g.spec for g in groups], 1000, 66, 16, 1)
    with pytest.raises(KVCacheTooSmallError, match="largest max_model_len that fits is 992"):
        check_max_model_len_fits([g.spec for g in groups], 1000, 65, 16, 1)
    config = plan_kv_cache_config(specs, 16, 1000, num_kv_blocks=68, max_step_tokens=32)
    assert config == KVCacheConfig(68, 16, groups)
    config.check_max_model_len_fits(1000, 32)
    # A window-only model of any length fits in a window's blocks.
    plan_kv_cache_config([W32] * 4, 16, 1_000_000, num_kv_blocks=3, max_step_tokens=1)


# ------------------------------------------------------------------------- giving blocks back


def test_blocks_leave_the_window_one_by_one_as_a_request_decodes():
    manager = KVCacheManager(8, 16, group_specs=[W32])
    history = tokens(40)
    assert admit(manager, "a", history) == ((0, 1, 2),)
    decode_to(manager, "a", history, 47)
    assert manager.block_tables("a") == ((0, 1, 2),)
    # The query at 47 reads 16 .. 47: block 0 (0 .. 15) is given back, a cached block (it is full).
    history.append(47)
    assert manager.allocate_slots("a", history, 47, 1) is NO_NEW_BLOCKS
    assert manager.block_tables("a") == ((None, 1, 2),)
    assert (manager.stats().blocks_used, manager.eviction_order()) == (2, [0])
    history.append(48)
    assert manager.allocate_slots("a", history, 48, 1) == ((3,),)
    assert manager.block_tables("a") == ((None, 1, 2, 3),)
    decode_to(manager, "a", history, 100)
    assert manager.block_tables("a") == ((None, None, None, None, 4, 5, 6),)
    assert manager.eviction_order() == [0, 1, 2, 3]
    manager.free("a")
    stats = manager.stats()
    assert stats.blocks_used == 0 and stats.blocks_cached + stats.blocks_free == 8


def test_full_groups_keep_everything_while_the_window_group_gives_back():
    manager = KVCacheManager(16, 16, group_specs=[FULL, W32])
    history = tokens(40)
    assert admit(manager, "a", history) == ((0, 1, 2), (3, 4, 5))
    decode_to(manager, "a", history, 65)
    assert manager.block_tables("a") == ((0, 1, 2, 6, 8), (None, None, 5, 7, 9))
    assert held(manager, "a", 0) == 5 and held(manager, "a", 1) == 3


def test_a_request_of_twenty_windows_holds_the_cap_from_the_first_window_on_and_leaks_nothing():
    window, size = 40, 16
    cap = math.ceil(window / size) + 1  # 4, which is ceil((w - 1) / 16) + 1 too
    spec = SlidingWindowSpec(1, 16, "float32", 4, sliding_window=window)
    manager = KVCacheManager(64, size, group_specs=[FULL, spec])
    history = tokens(8)
    admit(manager, "a", history)
    counts = []
    while len(history) < 20 * window:
        position = len(history)
        history.append(position)
        assert manager.allocate_slots("a", history, position, 1) is not None
        counts.append((position, held(manager, "a", 1)))
    after_first_window = [count for position, count in counts if position >= window]
    assert max(after_first_window) == cap and min(after_first_window) == cap - 1
    assert held(manager, "a", 0) == math.ceil(20 * window / size)  # the full group keeps every block
    manager.free("a")
    stats = manager.stats()
    assert stats.blocks_used == 0 and stats.blocks_free + stats.blocks_cached == 64


def test_a_chunk_longer_than_the_window_gets_all_its_blocks_and_gives_back_the_ones_before():
    manager = KVCacheManager(16, 16, group_specs=[W32])
    prompt = tokens(150)
    assert admit(manager, "a", prompt, num_new=48) == ((0, 1, 2),)
    # The chunk 48 .. 111 reads from 17 on: block 0 goes, blocks 3 .. 6 come.
    assert manager.allocate_slots("a", prompt, 48, 64) == ((3, 4, 5, 6),)
    assert manager.block_tables("a") == ((None, 1, 2, 3, 4, 5, 6),)
    # The chunk 112 .. 149 reads from 81 on: blocks 1 .. 4 go (81 is in block 5).
    assert manager.allocate_slots("a", prompt, 112, 38) == ((7, 8, 9),)
    assert manager.block_tables("a") == ((None, None, None, None, None, 5, 6, 7, 8, 9),)


def test_an_allocation_that_fails_still_gives_back_what_the_window_left():
    manager = KVCacheManager(4, 16, group_specs=[W32])
    prompt = tokens(100)
    assert admit(manager, "a", prompt, num_new=48) == ((0, 1, 2),)
    assert admit(manager, "b", tokens(10, start=500)) == ((3,),)
    # 48 .. 111 needs 4 more blocks; block 0 is given back (nothing reads it again) but 1 is not enough.
    assert manager.allocate_slots("a", prompt, 48, 64) is None
    assert manager.block_tables("a") == ((None, 1, 2),)
    assert manager.allocate_slots("a", prompt, 48, 16) == ((0,),)  # the block it gave back, evicted and reused


# ------------------------------------------------------------------------------ prefix caching


def test_a_window_hit_needs_only_the_blocks_before_its_end():
    manager = KVCacheManager(16, 16, group_specs=[W32])
    prompt = tokens(100)
    admit(manager, "a", prompt)
    manager.free("a")  # blocks 0 .. 5 cached (6 holds 4 tokens: not full)
    # 99 // 16 = 6 blocks may hit; the query at 96 reads 65 .. 96: blocks 4 and 5.
    assert manager.get_computed_blocks(prompt) == (((None, None, None, None, 4, 5),), 96)
    # The new block is the lowest free one: a's partial block 6, released to the free list.
    assert manager.allocate_slots("b", prompt, 96, 4, ((None, None, None, None, 4, 5),)) == \
        ((None, None, None, None, 4, 5, 6),)
    assert manager.refcount(4) == manager.refcount(5) == 1 and manager.refcount(0) == 0


def test_a_request_hits_the_longest_prefix_every_group_can_serve():
    manager = KVCacheManager(16, 16, group_specs=[FULL, W32])
    prompt = tokens(100)
    assert admit(manager, "a", prompt) == ((0, 1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12, 13))
    manager.free("a")
    assert manager.eviction_order() == [5, 4, 3, 2, 1, 0, 12, 11, 10, 9, 8, 7]
    assert manager.get_computed_blocks(prompt) == (((0, 1, 2, 3, 4, 5), (None, None, None, None, 11, 12)), 96)
    for filler in range(3):  # free blocks 14, 15, 6, 13 first, then the LRU's 5 and 4
        manager.allocate_slots(f"filler{filler}", tokens(1, start=9000 + filler), 0, 1)
    assert not manager.is_cached(4) and not manager.is_cached(5)
    # The full group serves 4 blocks; at 4 blocks the window group needs its blocks 2 and 3.
    assert manager.get_computed_blocks(prompt) == (((0, 1, 2, 3), (None, None, 9, 10)), 64)


def test_a_window_only_model_hits_after_its_early_blocks_were_evicted():
    manager = KVCacheManager(8, 16, group_specs=[W32])
    prompt = tokens(100)
    admit(manager, "a", prompt, num_new=48)
    manager.allocate_slots("a", prompt, 48, 52)  # blocks 0 given back; 1 .. 6 held
    manager.free("a")
    assert manager.eviction_order() == [0, 5, 4, 3, 2, 1]
    manager.allocate_slots("x", tokens(1, start=9000), 0, 1)  # takes free block 7
    manager.allocate_slots("y", tokens(1, start=9100), 0, 1)  # evicts block 0 (tokens 0 .. 15)
    assert manager.get_computed_blocks(prompt) == (((None, None, None, None, 4, 5),), 96)


def test_a_prefix_shorter_than_the_window_needs_every_block():
    manager = KVCacheManager(8, 16, group_specs=[SlidingWindowSpec(2, 16, "float32", 4, sliding_window=64)])
    prompt = tokens(40)
    admit(manager, "a", prompt)
    manager.free("a")
    assert manager.get_computed_blocks(prompt) == (((0, 1),), 32)
    # Block 1 evicted (the LRU's first: free() releases a table last-first): the query at 16
    # reads 0 .. 16, so block 0 alone is still a hit; the query at 32 would need block 1.
    for filler in range(7):  # the free blocks 3 .. 7 and 2, then block 1
        manager.allocate_slots(f"filler{filler}", tokens(1, start=9000 + filler), 0, 1)
    assert manager.is_cached(0) and not manager.is_cached(1)
    assert manager.get_computed_blocks(prompt) == (((0,),), 16)


def test_a_stale_window_hit_is_refused_before_anything_changes():
    manager = KVCacheManager(16, 16, group_specs=[W32])
    prompt = tokens(100)
    admit(manager, "a", prompt)
    manager.free("a")
    hit_blocks, num_cached = manager.get_computed_blocks(prompt)
    with pytest.raises(PagingError, match="no longer holds this request's prefix"):
        manager.allocate_slots("b", prompt, num_cached, 4, ((None, None, None, None, 5, 4),))
    assert manager.stats().blocks_used == 0


# ----------------------------------------------------------------------- copy-on-write and forks


def test_a_fork_shares_the_window_and_copies_on_write_in_every_group():
    manager = KVCacheManager(16, 16, group_specs=[FULL, W32])
    history = tokens(40)
    admit(manager, "parent", history)
    decode_to(manager, "parent", history, 60)
    assert manager.block_tables("parent") == ((0, 1, 2, 6), (None, 4, 5, 7))
    manager.fork("parent", "child", 59)
    assert manager.block_tables("child") == ((0, 1, 2, 6), (None, 4, 5, 7))
    assert [manager.refcount(b) for b in (0, 4, 6, 7)] == [2, 2, 2, 2] and manager.refcount(3) == 0
    child = history[:59] + [999]
    assert manager.allocate_slots("child", child, 59, 1) is NO_NEW_BLOCKS
    assert manager.take_blocks_to_copy() == [(6, 8), (7, 9)]
    assert manager.take_rewritten_request_ids() == {"child"}
    assert manager.block_tables("child") == ((0, 1, 2, 8), (None, 4, 5, 9))
    manager.free("parent")
    manager.free("child")
    assert manager.stats().blocks_used == 0


def test_preemption_frees_what_the_window_still_holds_and_readmission_hits_the_window():
    manager = KVCacheManager(16, 16, group_specs=[FULL, W32])
    history = tokens(40)
    admit(manager, "a", history)
    decode_to(manager, "a", history, 90)
    manager.free("a")  # preempted
    assert manager.stats().blocks_used == 0
    blocks, num_cached = manager.get_computed_blocks(history)
    assert num_cached == 80 and blocks[1][:3] == (None, None, None) and None not in blocks[1][3:]
    assert manager.allocate_slots("a", history, num_cached, len(history) - num_cached, blocks) is not None
    assert held(manager, "a", 1) == 3
