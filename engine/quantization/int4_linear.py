"""Int4Linear: 4-bit weights in groups along K (asymmetric: a scale and an offset per group).

The matmul is torch's `_weight_int4pack_mm_for_cpu` at every row count: at one row it reads a
quarter of bf16's bytes and runs ~3x faster than bf16 `F.linear` (benchmarks/quant_variants.py);
at 64 rows it is ~3x slower than bf16 on AMX, but dequantizing the nibbles to bf16 eagerly costs
as much as the op itself, so there is nothing faster to switch to. int4 is the mode for few
concurrent streams; bf16 is the mode for batch throughput.

Groups of 32 along K match the default model's GGUF (Q4_1 stores 32-element blocks with a scale
and a minimum), so re-quantizing its dequantized weights recovers them nearly exactly.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
# The group sizes torch's CPU op accepts. Larger groups read fewer scales (groups of 64: ~10% fewer
# bytes per layer), but re-quantizing the default model's Q4_1 weights in groups of 64 loses their
# 32-element grid: passage NLL +11% and a mean KL of 0.36 nat/token from bf16, against +0.15% and
# 0.004 with groups of 32 (benchmarks/quant_accuracy.py).
GROUP_SIZES = (32, 64, 128, 256)
# torch's CPU packing interleaves 16 output channels; it refuses other multiples.
OUT_FEATURES_MULTIPLE = 16


def int4_compatible(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    return out_features % OUT_FEATURES_MULTIPLE == 0 and in_features % group_size == 0


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scale [N, K/g], zero [N, K/g]) in float32, with
    weight ~= (q - 8) * scale + zero per group: the convention of torch's int4 CPU op."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, low + 8.0 * scale


class Int4Linear(nn.Module):
    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features = packed.shape[0]
        if scales_and_zeros.shape != (in_features // group_size, out_features, 2):
            raise ValueError(f"scales_and_zeros must be [K/g, N, 2] = [{in_features // group_size}, {out_features}, 2], "
                             f"got {tuple(scales_and_zeros.shape)}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # in the activation dtype: the op requires it
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE) -> "Int4Linear":
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
        if not int4_compatible(linear.out_features, linear.in_features, group_size):
            raise ValueError(f"int4 needs out_features % {OUT_FEATURES_MULTIPLE} == 0 and in_features % {group_size} "
                             f"== 0, got {linear.out_features} x {linear.in_features}")
        dtype = linear.weight.dtype
        q, scale, zero = quantize_int4(linear.weight, group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(linear.weight.device), 2)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(dtype)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, scales_and_zeros, group_size, linear.in_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")
