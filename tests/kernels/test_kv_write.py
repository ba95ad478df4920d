"""KV-cache writes: every path (the serving entry, which runs the C++ kernel on the CPU; plain
torch; Triton) lands each row in its slot, skips -1 padding and quantises for fp8, bit-identically."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import FP8_E4M3_MAX, FP8_KV_DTYPE, write_kv_cache
from kvserve.kernels.torch_attention import torch_write_kv_cache
from kvserve.kernels.triton_kv_write import triton_write_kv_cache

INTERPRETER_OR_CUDA = [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
WRITERS = {"serving": write_kv_cache, "torch": torch_write_kv_cache, "triton": triton_write_kv_cache}


def _caches(dtype: torch.dtype, device: str, num_kv_heads: int = 3, head_dim: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (6, num_kv_heads, 8, head_dim)
    return torch.zeros(shape, device=device).to(dtype), torch.zeros(shape, device=device).to(dtype)


@pytest.mark.parametrize("device", INTERPRETER_OR_CUDA)
@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_land_in_their_slots_and_padding_is_skipped(device: str, writer: str, dtype: torch.dtype) -> None:
    key = torch.randn(5, 3, 64, device=device).to(dtype)
    value = torch.randn(5, 3, 64, device=device).to(dtype)
    slots = torch.tensor([13, -1, 0, 47, 8], device=device)
    key_cache, value_cache = _caches(dtype, device)
    WRITERS[writer](key, value, key_cache, value_cache, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // 8, :, slot % 8], key[row])
            assert torch.equal(value_cache[slot // 8, :, slot % 8], value[row])
    written = torch.zeros(6 * 8, dtype=torch.bool)
    written[[13, 0, 47, 8]] = True
    untouched = key_cache.transpose(1, 2).reshape(48, -1)[~written.to(device)]
    assert torch.count_nonzero(untouched) == 0  # the -1 row went nowhere


@pytest.mark.parametrize("device", INTERPRETER_OR_CUDA)
def test_triton_write_equals_torch_write_for_fp8_with_scale(device: str) -> None:
    key = torch.randn(9, 2, 128, device=device)  # |key / k_scale| stays below 448 but for the outlier
    value = torch.randn(9, 2, 128, device=device)
    key[0, 0, 0] = 1e6  # an outlier saturates rather than becoming NaN
    slots = torch.tensor([3, 4, 5, -1, 30, 31, 32, 0, 47], device=device)
    results = []
    for writer in WRITERS.values():
        key_cache, value_cache = _caches(FP8_KV_DTYPE, device, num_kv_heads=2, head_dim=128)
        writer(key, value, key_cache, value_cache, slots, k_scale=0.02, v_scale=0.01)
        results.append((key_cache.float(), value_cache.float()))
    (serving_k, serving_v), (torch_k, torch_v), (triton_k, triton_v) = results
    assert torch.equal(torch_k, triton_k) and torch.equal(torch_v, triton_v)
    assert torch.equal(torch_k, serving_k) and torch.equal(torch_v, serving_v)
    assert torch_k[0, 0, 3, 0] == FP8_E4M3_MAX and not torch_k.isnan().any()
    dequantised = torch_k[0, :, 4] * 0.02  # slot 4 holds row 1
    torch.testing.assert_close(dequantised, key[1].cpu().float(), rtol=2**-4, atol=0.02 * 2**-10)  # e4m3: half an ulp of 3 mantissa bits


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, FP8_KV_DTYPE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.03])
def test_serving_write_equals_torch_bit_for_bit(dtype: torch.dtype, cache_dtype: torch.dtype, scale: float | None) -> None:
    generator = torch.Generator().manual_seed(0)
    key, value = (torch.randn(7, 3, 64, generator=generator).to(dtype) for _ in range(2))
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-3, 0.0])  # saturation in fp8, subnormals, zero
    slots = torch.tensor([5, -1, 40, 0, 47, 9, 16])
    caches = []
    for writer in (write_kv_cache, torch_write_kv_cache):
        key_cache, value_cache = _caches(cache_dtype, "cpu")
        # A strided key: a view of a fused qkv projection, as the model passes it.
        fused = torch.cat([key, value], dim=1)
        writer(fused[:, :3], value, key_cache, value_cache, slots, k_scale=scale, v_scale=scale)
        caches.append((key_cache.view(torch.uint8), value_cache.view(torch.uint8)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_write_rejects_slots_past_the_cache() -> None:
    key_cache, value_cache = _caches(torch.float32, "cpu")
    key = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="only 48 slots"):
        write_kv_cache(key, key, key_cache, value_cache, torch.tensor([1, 48]))
    with pytest.raises(ValueError, match="-1 for padding"):
        write_kv_cache(key, key, key_cache, value_cache, torch.tensor([1, -2]))


def test_write_rejects_rows_that_do_not_fit_the_cache() -> None:
    key_cache, value_cache = _caches(torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"\(kv_heads, head_dim\)"):
        write_kv_cache(torch.randn(2, 4, 64), torch.randn(2, 4, 64), key_cache, value_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="2 entries for 3"):
        write_kv_cache(torch.randn(3, 3, 64), torch.randn(3, 3, 64), key_cache, value_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="k_scale must be a positive"):
        write_kv_cache(torch.randn(2, 3, 64), torch.randn(2, 3, 64), key_cache, value_cache, torch.tensor([0, 1]), k_scale=0.0)


@pytest.mark.parametrize("device", INTERPRETER_OR_CUDA)
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_latent_cache_is_written_once_through_its_keys(device: str, writer: str) -> None:
    # One latent of 48 dims per token; the values are a view of its first 32 dims.
    latent_cache = torch.zeros(6, 1, 8, 48, device=device)
    values = latent_cache[..., :32]
    latent = torch.randn(4, 1, 48, device=device)
    slots = torch.tensor([3, -1, 17, 40], device=device)
    WRITERS[writer](latent, latent[..., :32], latent_cache, values, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(latent_cache[slot // 8, :, slot % 8], latent[row])
            assert torch.equal(values[slot // 8, :, slot % 8], latent[row, :, :32])
    assert torch.count_nonzero(latent_cache) == 3 * 48


@pytest.mark.parametrize("device", INTERPRETER_OR_CUDA)
@pytest.mark.parametrize("writer", list(WRITERS))
def test_values_narrower_than_keys_in_their_own_cache_are_written(device: str, writer: str) -> None:
    key_cache, value_cache = torch.zeros(6, 2, 8, 48, device=device), torch.zeros(6, 2, 8, 32, device=device)
    key, value = torch.randn(3, 2, 48, device=device), torch.randn(3, 2, 32, device=device)
    WRITERS[writer](key, value, key_cache, value_cache, torch.tensor([1, 9, 47], device=device))
    assert torch.equal(key_cache[1, :, 1], key[1]) and torch.equal(value_cache[5, :, 7], value[2])
