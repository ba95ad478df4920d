"""The Triton kernel against dense SDPA and the torch path. On CPU it runs in Triton's
interpreter (~1000x slower than compiled), so each case is one small mixed batch."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.torch_attention import torch_paged_attention
from kvserve.kernels.triton_attention import plan_launch, triton_paged_attention
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

# The interpreter runs CPU tensors only where CUDA is absent (conftest sets TRITON_INTERPRET=1).
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]

# One axis varied at a time around (fp32, head_dim 64, block 16, 2 KV heads x group 3).
CASES = {
    "gqa3": dict(),
    "mha": dict(group=1),
    "gqa8-mqa": dict(num_kv_heads=1, group=8),
    "mqa2": dict(num_kv_heads=1, group=2),
    "fp16": dict(dtype=torch.float16),
    "bf16": dict(dtype=torch.bfloat16),
    "head_dim128": dict(head_dim=128, num_kv_heads=1),
    "head_dim80": dict(head_dim=80, num_kv_heads=1),
    "block8": dict(block_size=8),
    "block32": dict(block_size=32),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_mixed_batch_matches_dense_and_torch(device: str, case: str) -> None:
    options = dict(num_kv_heads=2, group=3) | CASES[case]
    dtype = options.get("dtype", torch.float32)
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, device=device, **options)
    out = triton_paged_attention(*batch.attention_args(), check_block_tables=True)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float().cpu(), dense_attention(batch), **TOLERANCES[dtype])
    oracle = torch_paged_attention(*batch.attention_args())
    torch.testing.assert_close(out.float().cpu(), oracle.float().cpu(), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_kv_splits", [2, 3])
def test_split_kv_merge_matches_dense(device: str, num_kv_splits: int) -> None:
    # Decodes and chunks whose context is shorter than a split leave whole splits empty.
    batch = make_batch([200, 17, 1, 40], [1, 5, 1, 16], group=3, device=device)
    out = triton_paged_attention(*batch.attention_args(), num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out.cpu(), dense_attention(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_pure_decode_with_hints(device: str) -> None:
    seq_lens = [1, 15, 16, 17, 33, 200]
    batch = make_batch(seq_lens, [1] * len(seq_lens), group=3, device=device)
    out = triton_paged_attention(*batch.attention_args(), max_query_len=1, max_seq_len=200)
    torch.testing.assert_close(out.cpu(), dense_attention(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_num_decodes_hint(device: str) -> None:
    batch = make_batch(DECODES_FIRST_SEQ_LENS, DECODES_FIRST_QUERY_LENS, group=3, device=device)
    out = triton_paged_attention(*batch.attention_args(), num_decodes=NUM_DECODES, check_block_tables=True)
    torch.testing.assert_close(out.cpu(), dense_attention(batch), **TOLERANCES[torch.float32])
    decodes = make_batch([1, 15, 200], [1, 1, 1], group=3, device=device)  # all decodes: the decode-only plan
    out = triton_paged_attention(*decodes.attention_args(), num_decodes=3)
    torch.testing.assert_close(out.cpu(), dense_attention(decodes), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_dense_on_stored_values(device: str, dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, dtype=dtype, kv_dtype=FP8, kv_scale=0.05, device=device)
    out = triton_paged_attention(*batch.attention_args(), k_scale=0.05, v_scale=0.05)
    torch.testing.assert_close(out.float().cpu(), dense_attention(batch), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_query_view_from_a_fused_qkv_projection(device: str) -> None:
    batch = make_batch([33, 9], [5, 1], group=2, device=device)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)  # [T, 2 * heads, D]
    query_view = fused[:, : batch.query.shape[1]]
    assert not query_view.is_contiguous()
    out = triton_paged_attention(query_view, *batch.attention_args()[1:])
    torch.testing.assert_close(out.cpu(), dense_attention(batch), **TOLERANCES[torch.float32])


def test_plan_splits_long_contexts_of_few_requests_only() -> None:
    few_long = plan_launch(num_tokens=1, num_seqs=1, num_kv_heads=8, group=4, head_dim=128, max_context=32768, num_sms=132)
    many_short = plan_launch(num_tokens=256, num_seqs=256, num_kv_heads=8, group=4, head_dim=128, max_context=512, num_sms=132)
    prefill = plan_launch(num_tokens=2048, num_seqs=1, num_kv_heads=8, group=4, head_dim=128, max_context=2048, num_sms=132)
    assert few_long.num_splits > 1 and few_long.kv_split_len * few_long.num_splits >= 32768
    assert many_short.num_splits == 1 and prefill.num_splits == 1
    assert many_short.block_q * 4 >= 16  # tl.dot needs >= 16 rows on a GPU


def test_plan_never_launches_splits_that_can_hold_no_keys() -> None:
    plan = plan_launch(num_tokens=1, num_seqs=1, num_kv_heads=1, group=1, head_dim=64, max_context=100, num_sms=1, num_kv_splits=8)
    assert (plan.num_splits - 1) * plan.kv_split_len < 100


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [
    dict(),  # every head in one program
    dict(group_block=2),  # 8 heads in 4 head blocks, each program reading the whole context
    dict(group_block=4, num_kv_splits=2),  # head blocks and flash-decoding splits together
], ids=["one-block", "head-blocks", "head-blocks-split"])
def test_a_latent_cache_with_wider_keys_than_values_matches_dense_and_torch(device: str, options: dict) -> None:
    # Latent attention's absorbed form: keys of 32 latent + 16 rope dims (read as a 32-dim and a
    # 16-dim tile), values the keys' first 32 dims in the same memory, 8 heads on one KV head.
    batch = make_latent_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=8, device=device)
    out = triton_paged_attention(*batch.attention_args(), check_block_tables=True, **options)
    assert out.shape == (batch.query.shape[0], 8, 32)
    torch.testing.assert_close(out.float().cpu(), dense_attention(batch), **TOLERANCES[torch.float32])
    torch.testing.assert_close(out.cpu(), torch_paged_attention(*batch.attention_args()).cpu(), **TOLERANCES[torch.float32])


def test_plans_for_latent_attention_cut_128_heads_into_blocks_that_fit():
    # DeepSeek-V3: 128 heads on one KV head, 576-dim keys, 512-dim values.
    decode = plan_launch(num_tokens=8, num_seqs=8, num_kv_heads=1, group=128, head_dim=576, max_context=4096,
                         num_sms=132, value_dim=512)
    prefill = plan_launch(num_tokens=2048, num_seqs=1, num_kv_heads=1, group=128, head_dim=576, max_context=2048,
                          num_sms=132, value_dim=512)
    for plan in (decode, prefill):
        assert plan.group_block * plan.head_blocks == 128
        assert plan.block_q * plan.group_block * 512 <= 64 * 256  # the fp32 accumulator stays bounded
    assert decode.num_splits > 1  # 8 requests x 4 head blocks would leave most of 132 SMs idle
