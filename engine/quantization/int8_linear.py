"""Int8Linear: int8 weights with one scale per output channel (symmetric).

Two matmuls, chosen once per layer when it is built (`kernel`):
- "vnni" (where the CPU has AVX-512 VNNI and a compiler builds it): kvserve's own kernel
  (kernels/cpu_quant_gemm.py), activations quantized to int8 per group of 32, integer products,
  at every row count. Measured on a 2-core Zen 4 (SmolLM2's shapes and its lm_head, weights in
  cache): 1.4-8x faster than torch's route below at 17-1024 rows, ~0.5x its time at one row. Its
  weights live only in the kernel's layout: casting them back per call for an ordinary matmul
  (what this layer did past 16 rows) took 75-80 ms for the int4 mode's lm_head, against 2.7-27 ms.
- "torch": torch's `_weight_int8pack_mm` up to PACKED_MAX_ROWS rows (half the bytes of bf16, ~2x
  faster than bf16 `F.linear` at one row, activations untouched), and past them the weight cast to
  the activation dtype for the ordinary (AMX) matmul, because torch's op does not use AMX and falls
  to ~5x slower than bf16 at 64 rows while the cast costs ~1.5-2x bf16 (benchmarks/quant_variants.py,
  Sapphire Rapids). That branch is on the row count, a shape, so torch.compile guards on it rather
  than breaking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu_quant_gemm import int8_gemm, int8_gemm_compatible, pack_int8, quant_gemm_available

# Up to this many rows the packed op is faster than cast + matmul (measured crossover: 12-16 rows).
PACKED_MAX_ROWS = 16
KERNELS = ("auto", "vnni", "torch")  # auto: vnni where it runs (this CPU, a build, a shape in 16s and 32s), else torch


# Combines a row-parallel rank's per-channel maxima with its peers' (their elementwise maximum).
ReduceMax = Callable[[torch.Tensor], torch.Tensor]


def quantize_int8(weight: torch.Tensor, reduce_max: ReduceMax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scale [N] in float32) with weight ~= q * scale[:, None].
    reduce_max: for a slice of K (a row-parallel rank's), the maximum over every rank's slice,
    so that each channel's scale, and therefore every int8 value, is the unsharded layer's."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if reduce_max is not None:
        amax = reduce_max(amax)
    scale = amax.clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """`packed` None: `qweight` [N, K] and `scale` serve torch's op; else `packed` is the VNNI
    kernel's layout (weights and their scales inside it) for every row count, `qweight` is None,
    and `scale` is only the channels' scales on record."""

    def __init__(self, qweight: torch.Tensor | None, scale: torch.Tensor, bias: torch.Tensor | None,
                 packed: torch.Tensor | None = None, shape: tuple[int, int] | None = None) -> None:
        super().__init__()
        if packed is None and (qweight is None or qweight.dtype != torch.int8 or qweight.dim() != 2
                               or scale.shape != (qweight.shape[0],)):
            raise ValueError(f"need int8 [N, K] weights and [N] scales, got "
                             f"{None if qweight is None else (qweight.dtype, tuple(qweight.shape))} and "
                             f"{tuple(scale.shape)}")
        if packed is not None and (shape is None or scale.shape != (shape[0],)):
            raise ValueError("packed int8 weights need their [N, K] shape and [N] scales")
        self.out_features, self.in_features = shape if packed is not None else qweight.shape
        self.vnni = packed is not None
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)  # in the activation dtype: torch's op requires it
        self.register_buffer("packed", packed)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, reduce_max: ReduceMax | None = None, kernel: str = "auto") -> "Int8Linear":
        if kernel not in KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        shape = (linear.out_features, linear.in_features)
        fits = int8_gemm_compatible(*shape) and linear.weight.device.type == "cpu"
        if kernel == "vnni" and not (fits and quant_gemm_available()):
            raise ValueError(f"the int8 VNNI kernel cannot run a {shape[0]} x {shape[1]} layer on "
                             f"{linear.weight.device} here (N % 16, K % 32 on a CPU with AVX-512 VNNI and a C++ compiler)")
        dtype = linear.weight.dtype
        q, scale = quantize_int8(linear.weight, reduce_max)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if kernel == "vnni" or (kernel == "auto" and fits and quant_gemm_available()):
            return cls(None, scale.to(dtype), bias, packed=pack_int8(q, scale), shape=shape)
        return cls(q, scale.to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.vnni:
            out = int8_gemm(rows, self.packed)
        elif rows.shape[0] <= PACKED_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale)
        else:
            out = F.linear(rows, self.qweight.to(rows.dtype)) * self.scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={'vnni' if self.vnni else 'torch'}")
