"""The torch path against dense SDPA: every length, chunk mix, GQA ratio, dtype, head_dim, block size."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import paged_attention
from tests.kernels.paged_batch import FP8, MIXED_QUERY_LENS, MIXED_SEQ_LENS, TOLERANCES, dense_attention, make_batch

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _check(batch, dtype, **hints) -> None:
    out = paged_attention(*batch.attention_args(), **hints)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float().cpu(), dense_attention(batch), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8), (1, 1), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_dense(device: str, num_kv_heads: int, group: int, dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_kv_heads=num_kv_heads, group=group, dtype=dtype, device=device)
    _check(batch, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_head_dims_and_block_sizes(device: str, head_dim: int, block_size: int) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, head_dim=head_dim, block_size=block_size, device=device)
    _check(batch, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_pure_decode_with_hints_matches_dense(device: str) -> None:
    seq_lens = [1, 15, 16, 17, 33, 200]
    batch = make_batch(seq_lens, [1] * len(seq_lens), group=3, device=device)
    _check(batch, torch.float32, max_query_len=1, max_seq_len=max(seq_lens))
    _check(batch, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_whole_prompts_without_prefix_match_dense(device: str) -> None:
    # q_len == seq_len with group 1 takes SDPA's is_causal path; with group 3 the masked one.
    for group in (1, 3):
        batch = make_batch([15, 33, 1], [15, 33, 1], group=group, device=device)
        _check(batch, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache_matches_dense_on_stored_values(device: str) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, kv_dtype=FP8, kv_scale=0.05, device=device)
    out = paged_attention(*batch.attention_args(), k_scale=0.05, v_scale=0.05)
    torch.testing.assert_close(out.cpu(), dense_attention(batch), **TOLERANCES[torch.float32])


def test_padding_entries_of_block_tables_are_never_read() -> None:
    batch = make_batch([17, 3], [1, 3])
    poisoned = batch.block_tables.clone()
    poisoned[poisoned < 0] = 10_000  # past the cache: must be ignored because no position reaches it
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, poisoned, batch.seq_lens, batch.query_start_loc, batch.scale)
    torch.testing.assert_close(out, dense_attention(batch), **TOLERANCES[torch.float32])


def test_empty_batch_returns_empty_output() -> None:
    batch = make_batch([4], [1])
    empty = paged_attention(
        batch.query[:0], batch.key_cache, batch.value_cache, batch.block_tables[:0], batch.seq_lens[:0],
        batch.query_start_loc[:1], batch.scale,
    )
    assert empty.shape == (0, *batch.query.shape[1:])
