"""The one slot-mapping builder: exact positions, slots and offsets for a hand-made batch whose
block tables are shuffled and whose chunks cross block boundaries."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.attention_metadata import build_flat_batch

BLOCK = 4


def test_exact_slots_for_decodes_then_chunks_crossing_blocks():
    flat = build_flat_batch(
        query_lens=[1, 1, 6, 2],
        num_computed=[5, 0, 3, 0],
        group_block_ids=[[[9, 2], [7], [4, 0, 11], [6, 3]]],
        block_size=BLOCK,
    )
    (meta,) = flat.group_metadata
    assert flat.positions.tolist() == [5, 0, 3, 4, 5, 6, 7, 8, 0, 1]
    # pos 5 of [9, 2] -> block 2 row 1; pos 3..8 of [4, 0, 11] -> 4:3, 0:0..3, 11:0.
    assert meta.slot_mapping.tolist() == [9, 28, 19, 0, 1, 2, 3, 44, 24, 25]
    assert meta.block_tables.tolist() == [[9, 2, 0], [7, 0, 0], [4, 0, 11], [6, 3, 0]]
    assert meta.seq_lens.tolist() == [6, 1, 9, 2]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 8, 10]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_decodes) == (6, 9, 2)
    assert (meta.slot_mapping.dtype, meta.block_tables.dtype, meta.seq_lens.dtype, meta.query_start_loc.dtype) == (
        torch.int64, torch.int32, torch.int32, torch.int32)


@pytest.mark.parametrize(("query_lens", "num_decodes"), [([1, 1, 1], 3), ([3, 1, 1], 0), ([1, 2, 1], 1), ([2], 0)])
def test_only_leading_single_token_requests_count_as_decodes(query_lens, num_decodes):
    flat = build_flat_batch(query_lens, [4] * len(query_lens), [[[0, 1]] * len(query_lens)], BLOCK)
    assert flat.group_metadata[0].num_decodes == num_decodes


def test_every_slot_is_distinct_and_lands_in_the_request_s_own_blocks():
    tables = [[12, 3, 8, 1], [5, 10], [0, 7, 2]]
    flat = build_flat_batch([7, 2, 9], [6, 5, 0], [tables], BLOCK)
    slots = flat.group_metadata[0].slot_mapping.tolist()
    assert len(set(slots)) == len(slots) == 18
    starts = [0, 7, 9, 18]
    for i, table in enumerate(tables):
        assert {s // BLOCK for s in slots[starts[i]:starts[i + 1]]} <= set(table)


@pytest.mark.parametrize(("query_lens", "num_computed", "tables"), [
    ([3], [2], [[0]]),  # 5 tokens do not fit in one block of 4
    ([0], [2], [[0]]),  # a request must compute at least one token
    ([1, 1], [0], [[0], [1]]),  # one computed count missing
])
def test_inconsistent_requests_are_rejected(query_lens, num_computed, tables):
    with pytest.raises(ValueError):
        build_flat_batch(query_lens, num_computed, [tables], BLOCK)


def test_layer_groups_share_positions_and_lengths_but_not_slots():
    flat = build_flat_batch([1, 3], [5, 0], [[[9, 2], [7]], [[4, 6], [1]]], BLOCK)
    first, second = flat.group_metadata
    assert first.slot_mapping.tolist() == [9, 28, 29, 30] and second.slot_mapping.tolist() == [25, 4, 5, 6]
    assert first.block_tables.tolist() == [[9, 2], [7, 0]] and second.block_tables.tolist() == [[4, 6], [1, 0]]
    assert first.seq_lens is second.seq_lens and first.query_start_loc is second.query_start_loc
    assert flat.layer_metadata([1, 0, 1]) == [second, first, second]
    with pytest.raises(ValueError, match="table holds 0 blocks"):
        build_flat_batch([1, 3], [5, 0], [[[9, 2], [7]], [[4, 6], []]], BLOCK)
