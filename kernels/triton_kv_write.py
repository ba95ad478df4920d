"""KV-cache writes in Triton: one launch scatters (and, for fp8 or int8, quantises) a step's K/V rows.

The torch path needs a boolean gather of the valid slots, which syncs the host on a GPU; this
kernel masks the -1 padding slots instead, so a step's writes are one asynchronous launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.kv_quant import FP8_E4M3_MAX, INT8_MAX, check_int8_scales, check_scale
from kvserve.kernels.validation import (
    FP8_KV_DTYPE, INT8_KV_DTYPE, KernelInputError, check_write_shapes, check_write_values, values_alias_keys,
)


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 to the nearest e4m3 value (ties to even), still in fp32, so the final cast is
    exact. Doing the rounding ourselves makes the result independent of the conversion used:
    Triton's interpreter (3.9) drops the exponent carry when a mantissa rounds up (1.97 -> 1.0)."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits; the bias rounds to nearest, ties to even,
    # and a carry out of the mantissa correctly bumps the exponent.
    bias = 0x7FFFF + ((bits >> 20) & 1)
    normal = ((bits + bias) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    # Subnormal range (|x| < 2^-6) is a fixed grid of 2^-9: adding 1.5 * 2^14 leaves fp32 an ulp
    # of exactly 2^-9, so the hardware's round-to-nearest-even does the work.
    magic = 24576.0
    subnormal = (x + magic) - magic
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _round_half_even(x):
    """Round to the nearest integer, ties to even, as torch.round (|x| <= 127 here, so x + 0.5 is exact)."""
    rounded = tl.floor(x + 0.5)
    tie_to_odd = ((rounded - x) == 0.5) & ((rounded - 2.0 * tl.floor(rounded * 0.5)) == 1.0)
    return tl.where(tie_to_odd, rounded - 1.0, rounded)


@triton.jit
def _quantize_rows_int8(rows, mask, scales_ptr, scale_offsets, heads_valid, INT8_LIMIT: tl.constexpr):
    """kv_quant.quantize_rows_int8 on [heads, dims] fp32 rows: writes each row's scale, returns its int8 codes (in fp32)."""
    scales = tl.max(tl.where(mask, tl.abs(rows), 0.0), axis=1) / INT8_LIMIT
    tl.store(scales_ptr + scale_offsets, scales, mask=heads_valid)
    divisor = tl.where(scales > 0.0, scales, 1.0)
    return tl.clamp(_round_half_even(rows / divisor[:, None]), -INT8_LIMIT, INT8_LIMIT)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, key_scales_ptr, value_scales_ptr,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kb, stride_kch, stride_ks,
    stride_vb, stride_vch, stride_vs,
    stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    K_DIM: tl.constexpr, K_DIM_PAD: tl.constexpr, V_DIM: tl.constexpr, V_DIM_PAD: tl.constexpr,
    WRITE_VALUE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, IS_INT8: tl.constexpr,
    INT8_LIMIT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding row
        return
    heads = tl.arange(0, HEADS_PAD)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    k_dims = tl.arange(0, K_DIM_PAD)
    k_mask = (heads[:, None] < NUM_KV_HEADS) & (k_dims[None, :] < K_DIM)
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + k_dims[None, :], mask=k_mask, other=0.0)
    key = key.to(tl.float32) / k_scale
    if IS_FP8:  # e4m3fn has no inf: clamp so an outlier saturates instead of becoming NaN
        key = _round_to_e4m3(tl.clamp(key, -FP8_MAX, FP8_MAX))
    if IS_INT8:  # k_scale is 1 here: each row gets its own scale
        key = _quantize_rows_int8(key, k_mask, key_scales_ptr, block * stride_ksb + heads * stride_ksh + offset,
                                  heads < NUM_KV_HEADS, INT8_LIMIT)
    k_offsets = block * stride_kb + heads[:, None] * stride_kch + offset * stride_ks + k_dims[None, :]
    tl.store(key_cache_ptr + k_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=k_mask)
    if WRITE_VALUE:  # not for a latent cache, whose values are its keys' first V_DIM dims
        v_dims = tl.arange(0, V_DIM_PAD)
        v_mask = (heads[:, None] < NUM_KV_HEADS) & (v_dims[None, :] < V_DIM)
        value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + v_dims[None, :], mask=v_mask, other=0.0)
        value = value.to(tl.float32) / v_scale
        if IS_FP8:
            value = _round_to_e4m3(tl.clamp(value, -FP8_MAX, FP8_MAX))
        if IS_INT8:
            value = _quantize_rows_int8(value, v_mask, value_scales_ptr, block * stride_vsb + heads * stride_vsh + offset,
                                        heads < NUM_KV_HEADS, INT8_LIMIT)
        v_offsets = block * stride_vb + heads[:, None] * stride_vch + offset * stride_vs + v_dims[None, :]
        tl.store(value_cache_ptr + v_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=v_mask)


def triton_write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 = padding, not written
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    key_scales: torch.Tensor | None = None,  # int8 caches: [num_blocks, num_kv_heads, block_size] float32
    value_scales: torch.Tensor | None = None,
    check_slots: bool = False,
) -> None:
    """Same contract as `torch_attention.write_kv_cache`. `check_slots` reads the slot mapping
    (a host sync on CUDA) to reject slots past the cache; leave it off in serving."""
    check_write_shapes(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)
    k_scale_value, v_scale_value = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    check_int8_scales(key_cache.dtype, k_scale_value, v_scale_value)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise KernelInputError("key and value must be contiguous in head_dim (the last dimension); call .contiguous() first")
    if check_slots:
        check_write_values(slot_mapping, key_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, num_kv_heads, block_size, key_dim = key_cache.shape
    value_dim = value_cache.shape[3]
    if key_scales is None:  # never written without IS_INT8; any 3-d tensor fills the arguments
        key_scales = value_scales = key
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales,
        k_scale_value, v_scale_value,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_scales.stride(0), key_scales.stride(1), value_scales.stride(0), value_scales.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        K_DIM=key_dim, K_DIM_PAD=triton.next_power_of_2(key_dim),
        V_DIM=value_dim, V_DIM_PAD=triton.next_power_of_2(value_dim),
        WRITE_VALUE=not values_alias_keys(key_cache, value_cache),
        BLOCK_SIZE=block_size, IS_FP8=key_cache.dtype == FP8_KV_DTYPE, FP8_MAX=FP8_E4M3_MAX,
        IS_INT8=key_cache.dtype == INT8_KV_DTYPE, INT8_LIMIT=INT8_MAX,
    )
