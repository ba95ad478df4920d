"""Attention-logit soft-capping (Gemma 2: scores s -> c * tanh(s / c) after the scale, before the
softmax) in every backend: the C++ CPU kernel (the serving entry: its vector loop, its AMX route
for bf16 tiles where the CPU has AMX, and the fresh prompts it would otherwise hand to SDPA), the
plain torch path and the Triton kernel (in the interpreter on CPU), against the dense answer. The
queries are scaled up so that most scores pass the cap: an implementation that skips it misses
by far more than the tolerance (checked)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.kernels import paged_attention
from kvserve.kernels.torch_attention import torch_paged_attention
from tests.kernels.paged_batch import TOLERANCES, dense_attention, make_batch, poison_outside_window

# Decodes, chunks after context, a fresh prompt of 96 tokens (the C++ kernel's SDPA size) and short ones.
SEQ_LENS = [300, 20, 150, 96, 40, 1]
QUERY_LENS = [1, 1, 16, 96, 5, 1]
CAP = 5.0
IMPLEMENTATIONS = [pytest.param(paged_attention, id="serving"), pytest.param(torch_paged_attention, id="torch")]


def _batch(window: int = 0, **options):
    batch = make_batch(SEQ_LENS, QUERY_LENS, **options)
    batch = dataclasses.replace(batch, query=(batch.query.float() * 4.0).to(batch.query.dtype))  # scores of |s| ~ 4, many past the cap
    return poison_outside_window(batch, window) if window else batch


def test_the_cap_changes_the_answer_by_far_more_than_the_tolerance():
    batch = _batch()
    difference = (dense_attention(batch, soft_cap=CAP) - dense_attention(batch)).abs().max()
    assert difference > 100 * TOLERANCES[torch.float32]["atol"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window", [0, 33])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8)])
def test_capped_attention_matches_dense(implementation, window, num_kv_heads, group):
    batch = _batch(window, num_kv_heads=num_kv_heads, group=group)
    out = implementation(*batch.attention_args(), sliding_window=window, soft_cap=CAP)
    torch.testing.assert_close(out, dense_attention(batch, window, soft_cap=CAP), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_capped_attention_in_half_precision(implementation, dtype):
    # bf16 with head_dim 64 and tiles of <= 16 rows is the C++ kernel's AMX route where the CPU has it.
    batch = _batch(group=4, dtype=dtype)
    out = implementation(*batch.attention_args(), soft_cap=CAP)
    torch.testing.assert_close(out.float(), dense_attention(batch, soft_cap=CAP), **TOLERANCES[dtype])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_capped_attention_with_the_engine_hints(implementation):
    seq_lens, query_lens = [300, 20, 64, 150, 97], [1, 1, 1, 16, 70]
    batch = make_batch(seq_lens, query_lens, group=2)
    batch = dataclasses.replace(batch, query=batch.query * 4.0)
    out = implementation(*batch.attention_args(), soft_cap=CAP, num_decodes=3, max_query_len=70, max_seq_len=300)
    torch.testing.assert_close(out, dense_attention(batch, soft_cap=CAP), **TOLERANCES[torch.float32])


def test_a_cap_far_above_every_score_changes_nothing():
    batch = make_batch(SEQ_LENS, QUERY_LENS, group=2)
    for implementation in (paged_attention, torch_paged_attention):
        torch.testing.assert_close(implementation(*batch.attention_args(), soft_cap=1e6),
                                   implementation(*batch.attention_args()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [-1.0, float("nan")])
def test_a_negative_cap_is_refused(cap):
    batch = make_batch([20], [1])
    for implementation in (paged_attention, torch_paged_attention):
        with pytest.raises(ValueError, match="soft_cap must be >= 0"):
            implementation(*batch.attention_args(), soft_cap=cap)


TRITON_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("window,num_kv_splits,num_kv_heads,group", [(0, None, 2, 3), (0, 2, 1, 4), (33, 3, 2, 2)])
def test_triton_capped_attention_with_gqa_window_and_split_kv(device, window, num_kv_splits, num_kv_heads, group):
    pytest.importorskip("triton")
    from kvserve.kernels.triton_attention import triton_paged_attention

    seq_lens, query_lens = [200, 20, 97, 40], [1, 1, 40, 5]
    batch = make_batch(seq_lens, query_lens, num_kv_heads=num_kv_heads, group=group, device=device)
    batch = dataclasses.replace(batch, query=batch.query * 4.0)
    if window:
        batch = poison_outside_window(batch, window)
    out = triton_paged_attention(*batch.attention_args(), sliding_window=window, soft_cap=CAP, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out.cpu(), dense_attention(batch, window, soft_cap=CAP), **TOLERANCES[torch.float32])
