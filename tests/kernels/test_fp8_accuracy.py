"""The accuracy cost of an fp8 (e4m3) KV cache at the kernel level.

Gaussian K/V written with per-tensor scales (absmax / 448) and read back by attention stay within
5% relative (Frobenius) error of fp32 attention on the unquantised K/V; measured ~3.2% for
head_dim 64 and 128, in fp32 and bf16 queries. e4m3 keeps 3 mantissa bits, so each stored element
is off by up to 2^-4 relative; attention averages many of them, which is why the output error is
smaller than the per-element bound would suggest only in part (scores pass through exp).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import FP8_KV_DTYPE, fp8_scale_for, paged_attention, write_kv_cache
from kvserve.kernels.triton_attention import triton_paged_attention
from kvserve.kernels.triton_kv_write import triton_write_kv_cache
from tests.kernels.paged_batch import MIXED_QUERY_LENS, MIXED_SEQ_LENS, dense_attention, make_batch

FP8_RELATIVE_TOLERANCE = 0.05
ON_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
PATHS = {
    "torch": (write_kv_cache, paged_attention),
    "triton": (triton_write_kv_cache, triton_paged_attention),
}


def _fp8_relative_error(path: str, dtype: torch.dtype, head_dim: int, device: str) -> float:
    write, attend = PATHS[path]
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=3, head_dim=head_dim, dtype=dtype, device=device)
    reference = dense_attention(batch)
    k_scale = fp8_scale_for(max(k.abs().max().item() for k in batch.dense_keys))
    v_scale = fp8_scale_for(max(v.abs().max().item() for v in batch.dense_values))
    key_cache = torch.zeros_like(batch.key_cache, dtype=FP8_KV_DTYPE)
    value_cache = torch.zeros_like(key_cache)
    block_size = key_cache.shape[2]
    for i, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values, strict=True)):
        positions = torch.arange(k.shape[0], device=device)
        slots = batch.block_tables[i, positions // block_size].long() * block_size + positions % block_size
        write(k.to(device, dtype), v.to(device, dtype), key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
    out = attend(
        batch.query, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale,
        k_scale=k_scale, v_scale=v_scale,
    ).float().cpu()
    return ((out - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_torch_fp8_cache_error_is_bounded(device: str, dtype: torch.dtype, head_dim: int) -> None:
    error = _fp8_relative_error("torch", dtype, head_dim, device)
    assert 0 < error < FP8_RELATIVE_TOLERANCE  # > 0: the cache really was quantised


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=ON_CPU_ONLY), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_fp8_cache_error_is_bounded_and_matches_torch(device: str) -> None:
    triton_error = _fp8_relative_error("triton", torch.float32, 64, device)
    torch_error = _fp8_relative_error("torch", torch.float32, 64, device)
    assert 0 < triton_error < FP8_RELATIVE_TOLERANCE
    assert triton_error == pytest.approx(torch_error, rel=1e-3)  # same quantised bytes, same attention
