"""The C++ CPU kernel against the torch oracle, and what only it does (strided queries, wide
indices, threads, in-kernel bounds checks, the torch fallback for head dims it does not cover)."""

from __future__ import annotations

import random
import shutil
from dataclasses import replace

import pytest
import torch

from kvserve.kernels import paged_attention, write_kv_cache
from kvserve.kernels.cpu_attention import cpu_kernel_available, cpu_paged_attention
from kvserve.kernels.torch_attention import torch_paged_attention
from tests.kernels.paged_batch import FP8, TOLERANCES, dense_attention, make_batch


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    # Where a compiler exists the kernel must build: a broken build fails here instead of
    # silently testing the torch fallback twice.
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the torch path serves (covered by test_torch_attention.py)")
    assert cpu_kernel_available()


def _random_batch(seed: int, *, num_seqs: int, decodes_first: bool = False, **options):
    rng = random.Random(seed)
    seq_lens = [rng.choice([1, 15, 16, 17, 33, 200, rng.randint(1, 300)]) for _ in range(num_seqs)]
    query_lens = [1 if rng.random() < 0.6 else rng.randint(1, s) for s in seq_lens]
    if decodes_first:
        pairs = sorted(zip(query_lens, seq_lens, strict=True), key=lambda pair: pair[0] != 1)
        query_lens, seq_lens = [q for q, _ in pairs], [s for _, s in pairs]
    return make_batch(seq_lens, query_lens, seed=seed, **options), query_lens


def _kernel(batch, **scales) -> torch.Tensor:
    k_scale, v_scale = scales.get("k_scale", 1.0), scales.get("v_scale", 1.0)
    return cpu_paged_attention(*batch.attention_args()[:-1], batch.scale * k_scale, v_scale)


@pytest.mark.parametrize("seed", range(4))
# Groups cover row blocks of 1-4 rows, tiles that convert K/V once for several blocks, and
# tiles wider than 16 rows (a group of 24: one token per tile).
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (1, 8), (1, 4), (1, 5), (1, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_batches_match_the_torch_path(seed: int, num_kv_heads: int, group: int, dtype: torch.dtype) -> None:
    batch, _ = _random_batch(seed, num_seqs=9, num_kv_heads=num_kv_heads, group=group, dtype=dtype, block_size=(8, 16, 32)[seed % 3])
    torch.testing.assert_close(_kernel(batch).float(), torch_paged_attention(*batch.attention_args()).float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_the_torch_path(dtype: torch.dtype) -> None:
    batch, _ = _random_batch(7, num_seqs=9, group=3, dtype=dtype, kv_dtype=FP8, kv_scale=0.05)
    scales = dict(k_scale=0.05, v_scale=0.05)
    torch.testing.assert_close(_kernel(batch, **scales).float(), torch_paged_attention(*batch.attention_args(), **scales).float(), **TOLERANCES[dtype])


def test_both_threads_split_a_large_mixed_batch() -> None:
    batch, query_lens = _random_batch(11, num_seqs=40, decodes_first=True, group=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = paged_attention(*batch.attention_args(), num_decodes=query_lens.count(1))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, dense_attention(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,num_seqs", [(3, 25), (3, 24), (2, 40), (4, 7)])
def test_threads_taking_every_kv_head_of_a_sequence_at_once_match_the_torch_path(
        dtype: torch.dtype, num_kv_heads: int, num_seqs: int) -> None:
    # Enough (sequence, tile)s for each thread to take all KV heads of one at a time (25: an odd
    # count, the last claim alone; 24: exactly at the threshold), and too few for it (4 x 7), with
    # prompt chunks first: every head of every row must be computed once, by the right item.
    batch, _ = _random_batch(13 + num_seqs, num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=3, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = _kernel(batch)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.float(), torch_paged_attention(*batch.attention_args()).float(), **TOLERANCES[dtype])


def test_strided_query_and_int64_metadata() -> None:
    batch = make_batch([33, 9, 200], [5, 1, 1], group=3)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)  # [T, 2 * heads, D]: a qkv split's view
    query_view = fused[:, : batch.query.shape[1]]
    assert not query_view.is_contiguous()
    out = cpu_paged_attention(query_view, batch.key_cache, batch.value_cache, batch.block_tables.long(), batch.seq_lens.long(),
                              batch.query_start_loc.long(), batch.scale, 1.0)
    torch.testing.assert_close(out, dense_attention(batch), **TOLERANCES[torch.float32])


def test_head_dims_the_kernel_does_not_cover_fall_back_to_torch() -> None:
    batch = make_batch([17, 40], [1, 7], group=2, head_dim=24)
    torch.testing.assert_close(paged_attention(*batch.attention_args()), dense_attention(batch), **TOLERANCES[torch.float32])


def _bad_metadata():
    batch = make_batch([17, 5], [1, 5], group=2)
    past_cache = batch.block_tables.clone()
    past_cache[0, 1] = batch.key_cache.shape[0]
    return batch, {
        "block_past_cache": (dict(block_tables=past_cache), r"block_tables\[0, 1\] = \d+ is outside"),
        "more_queries_than_context": (dict(seq_lens=torch.tensor([17, 4], dtype=torch.int32)), "more query tokens than context"),
        "context_past_table": (dict(seq_lens=torch.tensor([200, 5], dtype=torch.int32)), "needs more than"),
        "starts_not_ending_at_tokens": (dict(query_start_loc=torch.tensor([0, 1, 5], dtype=torch.int32)), "ends at 5"),
    }


@pytest.mark.parametrize("case", list(_bad_metadata()[1]))
def test_unvalidated_calls_are_still_bounds_checked_by_the_kernel(case: str) -> None:
    batch, cases = _bad_metadata()
    changes, message = cases[case]
    args = dict(query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache, block_tables=batch.block_tables,
                seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc, scale=batch.scale) | changes
    with pytest.raises(ValueError, match=message):
        paged_attention(**args, validate=False)


def test_every_fp8_code_is_read_exactly() -> None:
    # 16 one-token requests; request i's value row holds codes 16i..16i+15, so out[i] = that row.
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).view(16, 1, 1, 16)
    value_cache = torch.cat([codes, codes], dim=2)  # block_size 2: row 1 is never read
    key_cache = torch.zeros_like(value_cache)
    out = cpu_paged_attention(
        torch.ones(16, 1, 16), key_cache, value_cache, torch.arange(16, dtype=torch.int32).view(16, 1),
        torch.ones(16, dtype=torch.int32), torch.arange(17, dtype=torch.int32), 1.0, 1.0,
    )
    torch.testing.assert_close(out.view(256), codes.view(256).float(), rtol=0, atol=0, equal_nan=True)


def test_every_fp8_code_is_read_exactly_by_bf16_decodes() -> None:
    # The same through bf16 queries and a head_dim of 64 (where AVX-512 BF16 is built, the decodes'
    # vdpbf16ps route widens the codes to bf16 itself): request i's value row holds codes
    # 64i..64i+63, its one key all weight, so out[i] = that row, NaN codes NaN.
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).view(4, 1, 1, 64)
    value_cache = torch.cat([codes, torch.full_like(codes, float("nan"))], dim=2)  # row 1 is never read
    key_cache = torch.zeros_like(value_cache)
    out = cpu_paged_attention(
        torch.ones(4, 1, 64, dtype=torch.bfloat16), key_cache, value_cache, torch.arange(4, dtype=torch.int32).view(4, 1),
        torch.ones(4, dtype=torch.int32), torch.arange(5, dtype=torch.int32), 1.0, 1.0,
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().view(256), codes.view(256).float(), rtol=0, atol=0, equal_nan=True)


def test_unvalidated_writes_are_still_checked_by_the_kernel_before_anything_is_written() -> None:
    key_cache, value_cache = torch.zeros(6, 3, 8, 64), torch.zeros(6, 3, 8, 64)
    key = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="only 48 slots"):
        write_kv_cache(key, key, key_cache, value_cache, torch.tensor([1, 48]), validate=False)
    assert torch.count_nonzero(key_cache) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1)])
def test_fresh_prompts_beside_decodes_and_later_chunks_match_the_torch_path(dtype: torch.dtype, num_kv_heads: int, group: int) -> None:
    # Fresh prompts of >= 64 tokens go through torch's SDPA on gathered K/V (one of 65, just past
    # a block edge; one of 130); a shorter one and a chunk after earlier context stay in the loop.
    # (bf16 chunks of >= 8 tokens take the prompt route instead wherever AVX-512 BF16 is built.)
    batch = make_batch([40, 65, 9, 130, 200], [1, 65, 9, 130, 70], num_kv_heads=num_kv_heads, group=group, dtype=dtype, seed=3)
    scales = dict(k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(_kernel(batch, **scales).float(), torch_paged_attention(*batch.attention_args(), **scales).float(),
                               **TOLERANCES[dtype])


def test_a_fresh_prompt_with_a_block_past_the_cache_is_refused() -> None:
    batch = make_batch([70], [70], group=2)
    tables = batch.block_tables.clone()
    tables[0, 4] = batch.key_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0, 4\] = \d+ is outside"):
        cpu_paged_attention(batch.query, batch.key_cache, batch.value_cache, tables, batch.seq_lens, batch.query_start_loc, batch.scale, 1.0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_long_contexts_and_chunks_across_softmax_segments_match_the_torch_path(head_dim: int, block_size: int) -> None:
    # bf16 tiles of <= 16 rows take AMX where the CPU has it, the softmax in segments of 256 keys:
    # contexts past one segment, chunks whose first rows see none of a later segment's keys, a
    # group of 16 (a full tile), partial chunks and blocks of 8 (two blocks a chunk).
    for num_kv_heads, group in [(3, 3), (1, 16), (2, 1)]:
        batch = make_batch([600, 270, 257, 1, 513], [1, 30, 5, 1, 1], num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                           dtype=torch.bfloat16, block_size=block_size, seed=head_dim + block_size)
        scales = dict(k_scale=0.5, v_scale=2.0)
        torch.testing.assert_close(_kernel(batch, **scales).float(), torch_paged_attention(*batch.attention_args(), **scales).float(),
                                   **TOLERANCES[torch.bfloat16])


def _poison_past_contexts(batch) -> None:
    """Every cache row past a context (the rest of its last block, the spare blocks): K huge (an
    fp8 cache's largest), V NaN, so reading one shows (a NaN score gets the weight 0 in the kernels' softmax; a huge one
    takes all the weight)."""
    block_size = batch.key_cache.shape[2]
    used = torch.zeros(batch.key_cache.shape[0], block_size, dtype=torch.bool)
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        used[batch.block_tables[i, positions // block_size].long(), positions % block_size] = True
    unused = ~used[:, None, :, None]
    if batch.key_cache.dtype == FP8:  # no masked_fill for fp8: its codes, 0x7e = 448 (its largest), 0x7f = NaN
        batch.key_cache.view(torch.uint8).masked_fill_(unused, 0x7E)
        batch.value_cache.view(torch.uint8).masked_fill_(unused, 0x7F)
        return
    batch.key_cache.masked_fill_(unused, 1e4)
    batch.value_cache.masked_fill_(unused, float("nan"))


def _assert_matches_dense_attention(args: tuple, batch) -> None:
    """The kernel on `args` (a batch's attention args without its scale) against fp32 dense
    attention, with and without k/v scales, and soft-capped: no NaN from a poisoned row."""
    for k_scale, v_scale in ((1.0, 1.0), (0.5, 2.0)):
        out = cpu_paged_attention(*args, batch.scale * k_scale, v_scale).float()
        assert not out.isnan().any()
        expected = dense_attention(replace(batch, scale=batch.scale * k_scale)) * v_scale
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])
    capped = cpu_paged_attention(*args, batch.scale, 1.0, soft_cap=2.0).float()
    torch.testing.assert_close(capped, dense_attention(batch, soft_cap=2.0), **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_bf16_decodes_of_every_group_match_the_torch_path_and_read_nothing_past_the_context(
        head_dim: int, group: int, block_size: int, kv_dtype: torch.dtype) -> None:
    # bf16 decodes (AMX tiles where the CPU has them and the cache is bf16, else vdpbf16ps where
    # there is AVX-512 BF16, else the vector loop) on a bf16 or fp8 cache, at contexts of one key,
    # a partial chunk, whole blocks, one past a block, past a softmax segment; every cache row past
    # a context is poisoned (_poison_past_contexts).
    seq_lens = [1, 7, 16, 17, 33, 300, 1000]
    batch = make_batch(seq_lens, [1] * len(seq_lens), num_kv_heads=2, group=group, head_dim=head_dim,
                       dtype=torch.bfloat16, kv_dtype=kv_dtype, block_size=block_size, seed=group * head_dim + block_size)
    _poison_past_contexts(batch)
    _assert_matches_dense_attention(batch.attention_args()[:-1], batch)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_bf16_prompt_chunks_match_the_torch_path_and_read_nothing_past_the_context(
        head_dim: int, block_size: int, kv_dtype: torch.dtype) -> None:
    # bf16 chunks of >= 8 tokens on a bf16 or fp8 cache take the prompt route wherever AVX-512 BF16
    # is built, in AMX tiles where the CPU has them, else in vdpbf16ps (a tile: 16 tokens
    # of one head; work items of 64 tokens; softmax segments of 512 keys): fresh prompts of 16, 17
    # (a last tile of one row), 65 (one token past an item) and 600 (past a segment); chunks after
    # earlier context ending mid-block (64 after 36, 530 after 570: rows on both sides of a
    # segment edge; 8 after 22, the shortest), a decode beside them; a query that is a strided view.
    seq_lens, query_lens = [16, 17, 65, 600, 100, 1100, 40, 30, 9], [16, 17, 65, 600, 64, 530, 20, 8, 1]
    for num_kv_heads, group in [(2, 1), (3, 3), (1, 8)]:
        batch = make_batch(seq_lens, query_lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=torch.bfloat16,
                           kv_dtype=kv_dtype, block_size=block_size, seed=head_dim + block_size + group)
        _poison_past_contexts(batch)
        fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)  # [T, 2 * heads, D]: a qkv split's view
        query = fused[:, : batch.query.shape[1]]
        args = (query, *batch.attention_args()[1:-1])
        _assert_matches_dense_attention(args, batch)
        # A window no shorter than a sequence hides none of its keys (those take the prompt route
        # still); the longer ones are masked by the window route.
        windowed = cpu_paged_attention(*args, batch.scale, 1.0, sliding_window=600).float()
        torch.testing.assert_close(windowed, dense_attention(batch, sliding_window=600), **TOLERANCES[torch.bfloat16])


def test_a_bf16_prompt_chunk_with_a_block_past_the_cache_is_refused() -> None:
    batch = make_batch([70], [70], group=2, dtype=torch.bfloat16)
    tables = batch.block_tables.clone()
    tables[0, 4] = batch.key_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0, 4\] = \d+ is outside"):
        cpu_paged_attention(batch.query, batch.key_cache, batch.value_cache, tables, batch.seq_lens, batch.query_start_loc, batch.scale, 1.0)
