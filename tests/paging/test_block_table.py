import pytest

from kvserve.paging import BlockTable


@pytest.mark.parametrize(("num_tokens", "more", "needed"), [(0, 0, 0), (0, 1, 1), (15, 1, 0), (16, 1, 1), (17, 15, 0), (17, 16, 1), (0, 33, 3)])
def test_new_blocks_needed_at_block_boundaries(num_tokens, more, needed):
    table = BlockTable(16, range(-(-num_tokens // 16)), num_tokens)
    assert table.num_new_blocks_needed(more) == needed


def test_append_tokens_needs_the_blocks_first():
    table = BlockTable(8)
    with pytest.raises(ValueError, match="append blocks first"):
        table.append_tokens(1)
    table.append_block(4)
    table.append_tokens(8)
    assert (table.num_tokens, table.capacity, table.num_unused_slots) == (8, 8, 0)
    with pytest.raises(ValueError, match="need 2 blocks"):
        table.append_tokens(1)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000])
def test_waste_is_at_most_block_size_minus_one(block_size, length):
    table = BlockTable(block_size)
    for block_id in range(table.num_new_blocks_needed(length)):
        table.append_block(block_id)
    table.append_tokens(length)
    assert 0 <= table.num_unused_slots <= block_size - 1


def test_block_ids_is_a_copy_and_replace_returns_the_old_block():
    table = BlockTable(16, [1, 2], 20)
    ids = table.block_ids
    ids.append(99)
    assert table.block_ids == [1, 2]
    assert table.replace_block(1, 5) == 2
    assert table.block_ids == [1, 5]
