"""Sliding-window attention in every backend: the C++ CPU kernel (the serving entry), the plain
torch path and the Triton kernel (in the interpreter on CPU) against dense SDPA with a window
mask, with the blocks before each request's window pointing at NaNs (a window group gives them
back, so a kernel must not read them even masked)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import paged_attention
from kvserve.kernels.torch_attention import torch_paged_attention
from tests.kernels.paged_batch import TOLERANCES, dense_attention, make_batch, poison_outside_window

# Decodes far past the window, one just inside it, chunks crossing it, a chunk longer than it, a
# fresh prompt longer than it (the C++ kernel's SDPA route must not take it), and short ones.
SEQ_LENS = [300, 20, 150, 97, 130, 40, 1]
QUERY_LENS = [1, 1, 16, 70, 130, 5, 1]
IMPLEMENTATIONS = [pytest.param(paged_attention, id="serving"), pytest.param(torch_paged_attention, id="torch")]


def _batch(window: int, **options):
    return poison_outside_window(make_batch(SEQ_LENS, QUERY_LENS, **options), window)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window", [1, 16, 33, 64])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8)])
def test_window_attention_matches_dense_and_reads_nothing_before_the_window(implementation, window, num_kv_heads, group):
    batch = _batch(window, num_kv_heads=num_kv_heads, group=group)
    out = implementation(*batch.attention_args(), sliding_window=window)
    torch.testing.assert_close(out, dense_attention(batch, window), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_window_attention_dtypes_and_block_sizes(implementation, dtype, block_size):
    batch = _batch(40, group=2, dtype=dtype, block_size=block_size)
    out = implementation(*batch.attention_args(), sliding_window=40)
    torch.testing.assert_close(out.float(), dense_attention(batch, 40), **TOLERANCES[dtype])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_window_attention_with_the_engine_hints(implementation):
    # Decodes first, as the engine orders a step, with its max lengths.
    seq_lens, query_lens = [300, 20, 64, 150, 97], [1, 1, 1, 16, 70]
    batch = poison_outside_window(make_batch(seq_lens, query_lens, group=3), 32)
    out = implementation(*batch.attention_args(), sliding_window=32, num_decodes=3, max_query_len=70, max_seq_len=300)
    torch.testing.assert_close(out, dense_attention(batch, 32), **TOLERANCES[torch.float32])


def test_a_window_wider_than_every_context_is_full_attention():
    batch = make_batch(SEQ_LENS, QUERY_LENS, group=2)
    for implementation in (paged_attention, torch_paged_attention):
        torch.testing.assert_close(implementation(*batch.attention_args(), sliding_window=10_000),
                                   implementation(*batch.attention_args()), atol=1e-6, rtol=1e-6)


def test_a_negative_window_is_refused():
    batch = make_batch([20], [1])
    for implementation in (paged_attention, torch_paged_attention):
        with pytest.raises(ValueError, match="sliding_window must be >= 0"):
            implementation(*batch.attention_args(), sliding_window=-1)


# The interpreter runs CPU tensors only where CUDA is absent (conftest sets TRITON_INTERPRET=1).
TRITON_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("num_kv_splits,num_kv_heads,group", [(None, 2, 3), (2, 1, 4), (3, 2, 3)])
def test_triton_window_attention_with_gqa_and_split_kv(device, num_kv_splits, num_kv_heads, group):
    pytest.importorskip("triton")
    from kvserve.kernels.triton_attention import triton_paged_attention

    seq_lens, query_lens = [200, 20, 97, 40], [1, 1, 40, 5]
    batch = poison_outside_window(make_batch(seq_lens, query_lens, num_kv_heads=num_kv_heads, group=group, device=device), 33)
    out = triton_paged_attention(*batch.attention_args(), sliding_window=33, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out.cpu(), dense_attention(batch, 33), **TOLERANCES[torch.float32])
