import pytest

from kvserve.paging import BlockAllocator, BlockAllocatorError, NoFreeBlocksError


def test_hands_out_the_lowest_free_id_first_released_ones_included():
    allocator = BlockAllocator(6, 16)
    assert [allocator.allocate() for _ in range(5)] == [0, 1, 2, 3, 4]
    for block in (3, 1):  # released out of order
        allocator.release(block)
    # The released ids come back lowest first, before the never-used 5: blocks handed out in
    # release order would scatter a request's blocks over memory.
    assert [allocator.allocate() for _ in range(3)] == [1, 3, 5]
    allocator.release(4)
    allocator.release(0)
    assert [allocator.allocate() for _ in range(2)] == [0, 4]
    allocator = BlockAllocator(4, 16)
    assert [allocator.allocate() for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(NoFreeBlocksError, match="all 4 KV cache blocks are in use"):
        allocator.allocate()


def test_reference_counts_keep_a_shared_block_until_the_last_release():
    allocator = BlockAllocator(2, 16)
    block = allocator.allocate()
    allocator.incref(block)
    assert allocator.refcount(block) == 2
    allocator.release(block)
    assert (allocator.refcount(block), allocator.num_used, allocator.num_free) == (1, 1, 1)
    allocator.release(block)
    assert (allocator.refcount(block), allocator.num_used, allocator.num_free) == (0, 0, 2)


def test_double_free_and_foreign_ids_raise_without_corrupting_state():
    allocator = BlockAllocator(3, 16)
    block = allocator.allocate()
    allocator.release(block)
    with pytest.raises(BlockAllocatorError, match="released more times"):
        allocator.release(block)
    with pytest.raises(BlockAllocatorError, match="released more times"):
        allocator.release(2)  # never handed out
    with pytest.raises(BlockAllocatorError, match="out of range"):
        allocator.release(3)
    with pytest.raises(BlockAllocatorError, match="out of range"):
        allocator.release(-1)
    with pytest.raises(BlockAllocatorError, match="allocate"):
        allocator.incref(2)  # a free block holds nothing to share
    assert (allocator.num_free, allocator.num_used, allocator.num_cached) == (3, 0, 0)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2]


def test_cached_blocks_are_evicted_least_recently_released_first_and_only_when_nothing_is_free():
    evicted: list[int] = []
    allocator = BlockAllocator(4, 16, on_evict=evicted.append)
    blocks = [allocator.allocate() for _ in range(3)]
    for block in (2, 0, 1):
        allocator.release(block, keep_cached=True)
    assert allocator.cached_lru_order() == [2, 0, 1]
    assert allocator.allocate() == 3 and evicted == []  # a free block first
    allocator.incref(0)  # a prefix hit takes block 0 back out of the LRU
    assert allocator.cached_lru_order() == [2, 1]
    assert allocator.allocate() == 2 and evicted == [2]
    assert allocator.allocate() == 1 and evicted == [2, 1]
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate()
    assert sorted(blocks) == [0, 1, 2]


def test_fill_counts_tokens_in_used_blocks_only():
    allocator = BlockAllocator(4, 8)
    a, b = allocator.allocate(), allocator.allocate()
    allocator.mark_filled(a, 8)
    allocator.mark_filled(b, 3)
    allocator.mark_filled(b, 2)  # never shrinks
    assert allocator.tokens_in_used_blocks == 11
    allocator.release(a, keep_cached=True)
    assert allocator.tokens_in_used_blocks == 3
    allocator.incref(a)  # a cached block comes back with its tokens
    assert allocator.tokens_in_used_blocks == 11
    allocator.release(b)
    with pytest.raises(BlockAllocatorError, match="not in use"):
        allocator.mark_filled(b, 1)
    with pytest.raises(ValueError, match="0..8"):
        allocator.mark_filled(a, 9)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_supported_block_sizes(block_size):
    assert BlockAllocator(1, block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [0, 4, 12, 128])
def test_unsupported_block_sizes_are_rejected(block_size):
    with pytest.raises(ValueError, match="block size must be one of"):
        BlockAllocator(1, block_size)


def test_needs_at_least_one_block():
    with pytest.raises(ValueError, match="at least 1"):
        BlockAllocator(0, 16)
