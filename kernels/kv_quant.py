"""KV-cache quantisation: how K/V values are stored and how a scale maps them back.

One rule for every cache dtype: the cache holds `x / scale` (saturated to the format's range) and
attention reads `stored * scale`. A `None` scale means 1.0. For float32/16/bf16 caches a scale is
legal but pointless; for float8_e4m3fn caches it moves the activations into e4m3's range
(|x| <= 448), whose 3 mantissa bits give ~2^-4 relative error per element.

Per-tensor scales (one for K, one for V per layer) are what vLLM calls `k_scale`/`v_scale`.
Attention folds them into arithmetic it does anyway (`k_scale` into the softmax scale,
`v_scale` into the output), so dequantisation costs no extra pass over the cache.
"""

from __future__ import annotations

import torch

from kvserve.kernels.validation import FP8_KV_DTYPE, KernelInputError

FP8_E4M3_MAX = 448.0


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
