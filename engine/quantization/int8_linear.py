"""Int8Linear: int8 weights with one scale per output channel (symmetric), activations untouched.

Which matmul runs depends on the row count, because the two candidates win in different places
(benchmarks/quant_variants.py, Sapphire Rapids, SmolLM2's shapes, interleaved in one process):
- few rows (a single stream, a handful of decodes): torch's `_weight_int8pack_mm` reads half the
  bytes of bf16 and is ~2x faster than bf16 `F.linear` at one row;
- many rows: that op does not use AMX and falls to ~5x slower than bf16 at 64 rows, while casting
  the weight to the activation dtype and running the ordinary (AMX) matmul costs ~1.5-2x bf16.
The branch is on the row count, a shape, so torch.compile guards on it rather than breaking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows the packed op is faster than cast + matmul (measured crossover: 12-16 rows).
PACKED_MAX_ROWS = 16


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
    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != (qweight.shape[0],):
            raise ValueError(f"need int8 [N, K] weights and [N] scales, got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {tuple(scale.shape)}")
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)  # in the activation dtype: the op requires it
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, reduce_max: ReduceMax | None = None) -> "Int8Linear":
        dtype = linear.weight.dtype
        q, scale = quantize_int8(linear.weight, reduce_max)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale.to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= PACKED_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale)
        else:
            out = F.linear(rows, self.qweight.to(rows.dtype)) * self.scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
