"""The CPU paths against dense SDPA: every length, chunk mix, GQA ratio, dtype, head_dim, block size.

Two implementations of one contract run here: `paged_attention` (the serving entry: the C++ kernel
on the CPU, see test_cpu_attention.py for what only it does) and `torch_paged_attention` (plain
torch, the oracle, on any device).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.kernels import paged_attention
from kvserve.kernels.torch_attention import torch_paged_attention
from tests.kernels.paged_batch import (
    DECODES_FIRST_QUERY_LENS,
    DECODES_FIRST_SEQ_LENS,
    FP8,
    MIXED_QUERY_LENS,
    MIXED_SEQ_LENS,
    NUM_DECODES,
    TOLERANCES,
    dense_attention,
    make_batch,
    make_latent_batch,
)

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
IMPLEMENTATIONS = [pytest.param(paged_attention, id="serving"), pytest.param(torch_paged_attention, id="torch")]


def _check(implementation, batch, dtype, **hints) -> None:
    out = implementation(*batch.attention_args(), **hints)
    assert out.shape == (*batch.query.shape[:2], batch.value_cache.shape[-1]) and out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float().cpu(), dense_attention(batch), **TOLERANCES[dtype])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8), (1, 1), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_dense(implementation, device: str, num_kv_heads: int, group: int, dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_kv_heads=num_kv_heads, group=group, dtype=dtype, device=device)
    _check(implementation, batch, dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_head_dims_and_block_sizes(implementation, device: str, head_dim: int, block_size: int) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, head_dim=head_dim, block_size=block_size, device=device)
    _check(implementation, batch, torch.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_pure_decode_with_hints_matches_dense(implementation, device: str) -> None:
    seq_lens = [1, 15, 16, 17, 33, 200]
    batch = make_batch(seq_lens, [1] * len(seq_lens), group=3, device=device)
    _check(implementation, batch, torch.float32, max_query_len=1, max_seq_len=max(seq_lens))
    _check(implementation, batch, torch.float32, num_decodes=len(seq_lens))
    _check(implementation, batch, torch.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_num_decodes_splits_decodes_from_chunks(implementation, device: str, dtype: torch.dtype) -> None:
    batch = make_batch(DECODES_FIRST_SEQ_LENS, DECODES_FIRST_QUERY_LENS, group=3, dtype=dtype, device=device)
    _check(implementation, batch, dtype, num_decodes=NUM_DECODES)
    _check(implementation, batch, dtype, num_decodes=NUM_DECODES, max_query_len=16, max_seq_len=200)
    _check(implementation, batch, dtype, num_decodes=0)  # every request as a chunk: a 1-token chunk is a decode
    _check(implementation, batch, dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_whole_prompts_without_prefix_match_dense(implementation, device: str) -> None:
    # q_len == seq_len with group 1 takes SDPA's is_causal path in torch; with group 3 the masked one.
    for group in (1, 3):
        batch = make_batch([15, 33, 1], [15, 33, 1], group=group, device=device)
        _check(implementation, batch, torch.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_dense_on_stored_values(implementation, device: str, dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, dtype=dtype, kv_dtype=FP8, kv_scale=0.05, device=device)
    out = implementation(*batch.attention_args(), k_scale=0.05, v_scale=0.05)
    torch.testing.assert_close(out.float().cpu(), dense_attention(batch), **TOLERANCES[dtype])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_padding_entries_of_block_tables_are_never_read(implementation) -> None:
    batch = make_batch([17, 3], [1, 3])
    poisoned = batch.block_tables.clone()
    poisoned[poisoned < 0] = 10_000  # past the cache: must be ignored because no position reaches it
    out = implementation(batch.query, batch.key_cache, batch.value_cache, poisoned, batch.seq_lens, batch.query_start_loc, batch.scale)
    torch.testing.assert_close(out, dense_attention(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_batch_returns_empty_output(implementation) -> None:
    batch = make_batch([4], [1])
    empty = implementation(
        batch.query[:0], batch.key_cache, batch.value_cache, batch.block_tables[:0], batch.seq_lens[:0],
        batch.query_start_loc[:1], batch.scale,
    )
    assert empty.shape == (0, *batch.query.shape[1:])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decodes_first", [False, True])
def test_a_latent_cache_attends_as_one_kv_head_with_wider_keys_than_values(implementation, device: str,
                                                                            dtype: torch.dtype, decodes_first: bool) -> None:
    # Latent attention's absorbed form: 48-dim keys (32 latent + 16 rope), 32-dim values that are
    # the keys' first 32 dims in the same memory, 8 query heads on the one KV head.
    seq_lens, query_lens = (DECODES_FIRST_SEQ_LENS, DECODES_FIRST_QUERY_LENS) if decodes_first else (MIXED_SEQ_LENS, MIXED_QUERY_LENS)
    batch = make_latent_batch(seq_lens, query_lens, num_heads=8, dtype=dtype, device=device)
    assert batch.value_cache.data_ptr() == batch.key_cache.data_ptr()
    _check(implementation, batch, dtype, **({"num_decodes": NUM_DECODES} if decodes_first else {}))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_values_narrower_than_keys_in_their_own_cache(implementation) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, head_dim=64)
    narrow = batch.value_cache[..., :32].contiguous()  # its own memory: gathered on its own
    batch = dataclasses.replace(batch, value_cache=narrow, dense_values=[v[..., :32] for v in batch.dense_values])
    _check(implementation, batch, torch.float32)
