"""KV-cache quantisation: how K/V values are stored and how a scale maps them back.

One rule for every cache dtype: the cache holds `x / scale` (saturated to the format's range) and
attention reads `stored * scale`. A `None` scale means 1.0. For float32/16/bf16 caches a scale is
legal but pointless; for float8_e4m3fn caches it moves the activations into e4m3's range
(|x| <= 448), whose 3 mantissa bits give ~2^-4 relative error per element.

Per-tensor scales (one for K, one for V per layer) are what vLLM calls `k_scale`/`v_scale`.
Attention folds them into arithmetic it does anyway (`k_scale` into the softmax scale,
`v_scale` into the output), so dequantisation costs no extra pass over the cache.

int8 caches scale per row instead: each token's K (and V) row of each KV head gets its own
float32 scale, absmax / 127 (symmetric), computed when the token is written and stored beside
the blocks ([num_blocks, kv_heads, block_size] per layer: the cache's shape without head_dim,
paged by the same block ids). Attention reads `stored * row_scale`, folding a key's scale into
its score and a value's into its softmax weight. 8 bits with a scale per 64-128 values keep ~2^-8
of each row's largest value, against e4m3's 2^-4 relative per element; the scales cost 4 bytes
per row (6% of an int8 row of 64 dims). A zero row gets scale 0 (and zeros).
"""

from __future__ import annotations

import torch

from kvserve.kernels.validation import FP8_KV_DTYPE, INT8_KV_DTYPE, KernelInputError

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0


def fp8_scale_for(absmax: float, headroom: float = 1.0) -> float:
    """The scale that maps |x| <= absmax onto e4m3's full range; `headroom` > 1 leaves room for
    activations larger than the calibration saw (they saturate rather than overflow)."""
    if absmax <= 0 or headroom <= 0:
        raise KernelInputError(f"fp8 scale needs a positive absmax and headroom, got absmax={absmax}, headroom={headroom}")
    return absmax * headroom / FP8_E4M3_MAX


def check_scale(name: str, scale: float | None) -> float:
    """The scale as a float (1.0 for None); rejects values that would poison the cache."""
    if scale is None:
        return 1.0
    value = float(scale)
    if not value > 0 or value == float("inf"):
        raise KernelInputError(f"{name} must be a positive finite float, got {scale!r}")
    return value


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x / scale` in the cache's dtype; fp8 saturates instead of producing NaN on overflow."""
    if cache_dtype == FP8_KV_DTYPE:
        return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)
    if scale == 1.0:
        return x.to(cache_dtype)
    return (x.float() / scale).to(cache_dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (int8 rows, their float32 scales [...]): q = round(x / s), ties to even,
    s = absmax / 127. Every backend's write computes exactly this (the same fp32 division and
    rounding), so their caches agree bit for bit."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    rows = torch.round(x / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(INT8_KV_DTYPE)
    return rows, scales


def row_scales(scales: torch.Tensor | None) -> torch.Tensor | None:
    """An int8 cache's scales as float32 [num_blocks, kv_heads, block_size], from that or from
    the bytes the engine's pages hold them in ([..., 4] int8, engine/kv_cache_tensors.py: a
    compiled forward cannot mutate a float32 view of the cache's int8 storage, so its graph sees
    the bytes and the kernels read them as floats)."""
    if scales is not None and scales.dtype == INT8_KV_DTYPE and scales.dim() == 4 and scales.shape[-1] == 4:
        return scales.view(torch.float32)[..., 0]
    return scales


def check_int8_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """An int8 cache carries its own per-row scales: a per-tensor scale on top would be a second rule."""
    if cache_dtype == INT8_KV_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise KernelInputError(f"int8 KV caches scale per token; k_scale/v_scale must be None, got {k_scale} and {v_scale}")
